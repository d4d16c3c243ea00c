"""What the connector's two sides exchange, and nothing else: the per-step
plan and report and how both size the tiers (`metadata`), the figures for
vLLM's log and Prometheus endpoint (`stats`), and `head_start`, the
in-process hand-over of a just-built plan to a worker that runs in the
scheduler's own process. The scheduler side and the worker side never import
each other; both import this.
"""
