"""The embedded testbed's tools that sit above the engines (they compose configs): measuring a
model's token-entropy profile on the toy task. The tiny model itself is built in `models/`,
because `train`, `eval` and `data prep` build it on first use."""
