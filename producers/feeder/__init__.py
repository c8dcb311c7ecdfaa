"""`sao feed`, the prompt feeder: its own process, beside the rollout producers it feeds.

`service.py` publishes prompts with backpressure; `datasets.py` reads the datasets it feeds from.
"""
