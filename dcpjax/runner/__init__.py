"""The worker side of a step: the model on the mesh and its compiled step (`model_runner`), the
packed step input (`step_input`) and output (`step_output`), and the KV pools' sizes
(`kv_layout`, `kv_budget`: plain arithmetic, importable without flax, as the planner does).

Nothing is imported here, so `dcpjax.runner.kv_layout` stays light."""
