"""The planner's units, in a module of their own so that every planner module can import them
(deployment, planner and experts import each other's functions; these constants import nothing)."""

GB = 1e9  # the planner's tables count decimal gigabytes
FP8 = "float8_e4m3fn"  # fp8 block-scaled weights, as `weight_bytes_per_device` counts them
