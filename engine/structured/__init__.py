"""Constrained decoding: output constraints (``spec``, standard library only), their
compilation into per-request grammar matchers (``compiler``, llguidance), the model's
vocabulary as the library sees it (``vocab``) and each step's token masks (``masks``,
torch). docs/structured.md."""
