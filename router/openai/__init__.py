"""The OpenAI-compatible HTTP surface: request schemas and the fields served or refused, response bodies and
server-sent events, tool calls, and the aiohttp gateway over the router's request pipeline."""
