"""Submitting runs elsewhere and following them: `stapoctl submit` (local, a Ray job server,
SLURM through submitit), sweep trials as jobs, the local job records and `stapoctl jobs`.
Above the trainer (a job body calls `train`); the Ray runtime the trainer itself uses is in
`launch/`."""
