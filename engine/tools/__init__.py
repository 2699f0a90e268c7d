"""Tool calls: the request's tools (``spec``, standard library only), the model's call
format and how tools reach its prompt (``formats``), the grammar its calls are held to
(``grammar``) and the split of its reply into content and calls (``stream``).
docs/structured.md, "Tool calls"."""
