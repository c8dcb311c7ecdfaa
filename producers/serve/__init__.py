"""`sao serve`, the inference server and rollout proxy: its own process, for `--backend http`
producers and for external agents.

`service.py` is the server and its routes; `api.py` the OpenAI-compatible request and response
shapes (what is refused, and why); `proxy.py` the rollout proxy's sessions, published as trajectories.
"""
