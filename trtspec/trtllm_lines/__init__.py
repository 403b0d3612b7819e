"""What each TensorRT-LLM line takes, in one room below the spec: the LLM API's field names
(fields.py, read from upstream at recorded commits) and the rules a spec for that line must
keep (rules.py, run when a spec loads)."""
