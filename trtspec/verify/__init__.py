"""The gate: is a speculative deployment safe to ship, and still worth running?

  run          `trtspec verify` as one call: VerifyOptions in, VerifyOutcome out
  backends     where both paths run: torch engines or the LLM API in process, or over gRPC
  reports      the terminal table and JUnit XML
  identity     both paths greedy on every prompt, compared by token id (VerifyReport)
  verdicts     a divergence classed numerical or algorithmic by replaying the target alone
  acceptance   the acceptance regression gate against a previous report
  sampling     `--sampling N`: speculative samples tested against the target's distribution
  html_report  `--html`: the self-contained page

Listed top down: a module imports only those below it (pyproject.toml's import-linter contract).
"""
