"""Sweeps: a family of `train` runs (one per swept value and seed) under one MLflow parent run.

`definition` reads `sweeps/NAME.yaml` and the command line, `plan` turns a definition into
trials (each a full list of Hydra overrides), `store` keeps the parent and children in MLflow,
`layout` names their tags and params, `runner` runs the trials here on warm engines (or hands
them to `parallel`, which runs `max_parallel=K` at once through `launchers`: processes here or
Ray jobs), `outcome` settles what they came to, `progress` draws the sweep's line above each
trial's live view.
"""
