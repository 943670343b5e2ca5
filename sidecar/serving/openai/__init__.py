"""The OpenAI-compatible HTTP front door: /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.

`protocol` turns request bodies into SamplingParams (400 naming the bad parameter), `chat` renders the checkpoint's
chat template with transformers, `reasoning` and `tool_calls` split the model's text into OpenAI's fields (pure
functions, streamed as deltas by `output`), `app` is the aiohttp application over the serving Frontend.
"""
