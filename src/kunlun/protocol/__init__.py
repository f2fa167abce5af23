"""The wire protocols the worker and the gateway share: the OpenAI-compatible request shapes
(:mod:`~kunlun.protocol.openai_api`), the serving errors with the one error-to-HTTP mapping
(:mod:`~kunlun.protocol.openai_errors`), a JSON body read into a request model with the 400
naming the field (:mod:`~kunlun.protocol.request_body`), the fields refused and those
deliberately ignored (:mod:`~kunlun.protocol.fields`), tool calls and their per-template
formats (:mod:`~kunlun.protocol.tools`, :mod:`~kunlun.protocol.tool_formats`), server-sent
events (:mod:`~kunlun.protocol.sse`), answers built from engine outputs
(:mod:`~kunlun.protocol.responses`), the embeddings request
(:mod:`~kunlun.protocol.embedding_request`) and SGLang's native ``/generate``
(:mod:`~kunlun.protocol.sglang`). Imports the engine's request types, never a process."""
