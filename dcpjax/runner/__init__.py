"""The worker side of a step: the scheduler's messages in and the outputs back (`messages`), what
it keeps of each request by id (`request_states`), the model on the mesh and its compiled calls
(`model_runner`), the calls packed from the messages (`call_builder`) onto the shapes of
`shape_grid` (compiled before ready by `precompile`), the packed step input (`step_input`) and
output (`step_output`), the compilations watched (`compile_watch`), and the KV pools' sizes
(`kv_layout`, `kv_budget`: plain arithmetic, importable without flax, as the planner does).

Nothing is imported here, so `dcpjax.runner.kv_layout` stays light."""
