"""The scale model: a discrete-event simulator of an MServe cluster (`python -m lab.simulate`).

`core` (event loop, CPU pool), `costs` (per-stage cost files), `workload` (trace shapes),
`cluster` (coordinator, routing and the worker roles), `gpu_costs` (the GPU-class cost file).
"""
