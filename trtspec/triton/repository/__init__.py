"""Writing a Triton model repository: typed configs rendered to config.pbtxt and parsed back."""
