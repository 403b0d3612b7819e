"""The lab: benchmark scripts, their result files and the figures script behind docs/performance.md and lab/RECORDS.md.
Outside the product: run from the repository root (`python -m lab.NAME`),
reaching trtspec through its public modules only; trtspec never imports it."""
