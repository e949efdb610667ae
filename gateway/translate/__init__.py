"""Client dialects served on top of the engine's one chat route.

``/v1/messages`` (Anthropic Messages API) and ``/v1/responses`` (OpenAI Responses API) are
translated here into a chat-completions body, and the engine's chat answer (JSON or SSE chunks)
is translated back. Everything else (auth, limits, admission, thinking policy, ``cache_salt``,
accounting) is the chat pipeline's, so no dialect can bypass it. No I/O in this package.

Modules: `common` (shared helpers), `chat_events` (the engine's answer as events), `plan`
(planning as chat), `relay` (the stream relay), `anthropic_request`, `anthropic_stream` (SSE and
JSON answers), `anthropic_errors`, `responses_request`, `responses_stream`, `responses_errors`,
`responses_store` (tenant-scoped stored responses).
"""
