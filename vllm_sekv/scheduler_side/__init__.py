"""The connector's scheduler side, in the engine-core process on vLLM's
scheduler thread: translates vLLM's scheduler calls for the workspace's
planner (`scheduler_connector`), runs requests served from execution views
(`view_coordinator`, with each request's `view_job` and the probes'
`view_ranking`; `engine_scheduler`), and asks the shared tier what it holds
(`remote_lookup`). Bookkeeping only: the bytes live in the workers.
"""
