"""Moving rotary-embedded keys: `rotate_keys` (a rotation by position deltas),
`scatter_rerope` (packed blocks -> paged caches), `dequantize_rerope` (an fp8
pool's blocks -> model-dtype K/V) and `gather_rerope` (paged caches -> a
capture buffer), each Triton (`rotate`, `scatter`, `dequant`, `gather`) beside
a PyTorch reference (`rotate_reference`, `scatter_reference`,
`dequant_reference`); the model's rotation itself is a `RopeSpec`
(`rope_spec`). Call them through `vllm_sekv.ops`, which picks the
implementation by device."""
