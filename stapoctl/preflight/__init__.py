"""Preflight: the checks that need the environment (files, models and tokenizers, `resume=`, the
machine's GPUs and cores, the run dir's disk, the tracking store), run before any MLflow run, run
dir or Ray exists. Above the libraries and engines it consults, below `eval` and `trainer`.
The config alone is checked lower down, in `config.validate`."""
