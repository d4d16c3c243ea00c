"""Moving rotary-embedded keys: `rotate_keys` (a rotation by position deltas),
`scatter_rerope` (packed blocks -> paged caches) and `gather_rerope` (paged
caches -> a capture buffer), each Triton (`rotate`, `scatter`, `gather`) beside
a PyTorch reference (`rotate_reference`, `scatter_reference`); the model's
rotation itself is a `RopeSpec` (`rope_spec`). Call them through
`vllm_sekv.ops`, which picks the implementation by device."""
