"""Rewriting the generated part of a section of docs/benchmarks.md, leaving the
hand-written text around it alone."""

from __future__ import annotations


def replace_block(doc: str, heading: str, block: str, tag: str) -> str:
    """``doc`` with the text between the markers ``<!-- {tag}: begin -->`` and
    ``<!-- {tag}: end -->`` replaced by ``block``; when the markers are missing they are
    added (with ``block``) at the end of the section whose heading starts with ``heading``.

    Raises:
        ValueError: the markers are missing and ``heading`` is not in ``doc``.
    """
    begin, end = f"<!-- {tag}: begin -->", f"<!-- {tag}: end -->"
    new = f"{begin}\n{block}\n{end}"
    if begin in doc and end in doc:
        a, b = doc.index(begin), doc.index(end) + len(end)
        return doc[:a] + new + doc[b:]
    i = doc.index(heading)
    j = doc.find("\n## ", i + len(heading))
    j = len(doc) if j < 0 else j
    return doc[:j].rstrip("\n") + "\n\n" + new + "\n" + doc[j:]
