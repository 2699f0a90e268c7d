"""Prefill/decode disaggregation: KV pages of a prompt moved from the engine that
computed them (role "prefill") to the engine that decodes (role "decode").

``pages``: the step-thread verbs (read a prompt's cached pages out of the pool; adopt
received pages into the pool and the radix tree). ``pull``: the decode side's fetch over
the internal link, each page checked on arrival. docs/scaling.md says when to use it.
"""
