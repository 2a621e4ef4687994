"""The base layer, which every other package may import and which imports none of them:

- `lwm.base.config`: YAML configs with `base:` links and `key=value` overrides, validated
  into typed classes, with one error line naming the key (`ConfigError`);
- `lwm.base.mesh`: the `(dp, fsdp, sp, tp)` device mesh and the logical axis rules;
- `lwm.base.media`: reading videos and images (decord, PyAV) and writing MP4/PNG atomically;
- `lwm.base.files`: atomic writes (a temporary name, renamed when complete);
- `lwm.base.metrics`: ``metrics.jsonl`` and TensorBoard scalars of a training run;
- `lwm.base.distributed`: joining a multi-process JAX job (`init_distributed`);
- `lwm.base.lock`: one run per output (`output_lock`);
- `lwm.base.checkpoints`: the newest checkpoint of a run that restores (`restore_first`);
- `lwm.base.signals`: SIGINT and SIGTERM noted for a run to stop between steps (`StopSignals`);
- `lwm.base.precision`: the float32 products' precision a model's config names (`with_precision`).
- `lwm.base.compile_cache`: compiled programs kept on disk between commands
  (`use_compilation_cache`).

Layers, bottom to top (a test walks every import): base -> `vqgan` -> `data` -> the model
(`lwm.model`, `lwm.attention`, `lwm.loss`, `lwm.weights`) -> training, inference and
evaluation -> `lwm.commands`, `lwm.cli`.
"""
