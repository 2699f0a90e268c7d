"""Files attached to a chat message: which kinds are read, how their text is extracted,
and the one form in which that text enters the prompt (docs/protocol.md, "Attachments").

Extraction runs in the gateway for every kind (``POST /api/attachments``): one code path
checks type, size and encoding for the page, the terminal client and tests alike, and a
PDF needs a library the browser does not have (pypdf, pure Python). The page sends the
returned text with its ``chat`` frame; the chat stores it in the user message
(``attachments``), so exports and imports carry it, and every later turn renders the
message the same way, byte for byte, so its KV is reused from the prefix cache.
"""

from __future__ import annotations

import io
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError

__all__ = ["ATTACHMENT_LIMITS", "Attachment", "AttachmentLimits", "extract", "parse_attachments", "prompt_content",
           "estimate_tokens"]

# file name extensions read as text (lower case, without the dot); anything else but
# .pdf is refused as an unknown type
TEXT_KINDS: dict[str, str] = {
    **{e: "text" for e in ("txt", "text", "log", "rst", "tex", "ini", "cfg", "conf", "toml", "yaml", "yml",
                           "env", "properties")},
    **{e: "markdown" for e in ("md", "markdown", "mdx")},
    **{e: "csv" for e in ("csv", "tsv")},
    **{e: "json" for e in ("json", "jsonl", "ndjson", "geojson")},
    **{e: "code" for e in ("py", "pyi", "js", "mjs", "cjs", "ts", "tsx", "jsx", "java", "kt", "kts", "c", "h",
                           "cc", "cpp", "cxx", "hpp", "hh", "cs", "go", "rs", "rb", "php", "swift", "scala",
                           "sh", "bash", "zsh", "fish", "ps1", "bat", "sql", "r", "jl", "lua", "pl", "pm",
                           "hs", "ml", "mli", "ex", "exs", "erl", "clj", "dart", "vue", "svelte", "html",
                           "htm", "css", "scss", "sass", "less", "xml", "svg", "gradle", "cmake", "mk",
                           "dockerfile", "makefile", "proto", "graphql", "tf", "nix", "zig", "v", "vhd",
                           "asm", "s", "ipynb")},
}
KINDS = frozenset(TEXT_KINDS.values()) | {"pdf"}
_NAMED = {"makefile": "code", "dockerfile": "code", "readme": "text", "license": "text"}
# an estimate of tokens per UTF-8 byte for the context meter when no tokenizer is at hand:
# one token per 3 bytes over-counts English BPE text (about 4 bytes a token), so a file
# the meter lets through is not refused by the engine for its size
BYTES_PER_TOKEN = 3


@dataclass(frozen=True)
class AttachmentLimits:
    """Attachment sizes (docs/protocol.md, "Attachments").

    Attributes:
        max_upload_bytes: largest file ``POST /api/attachments`` reads (bytes; 413 above).
        max_chars: most characters of one attachment's text.
        max_per_message: most attachments on one message.
        max_pdf_pages: most pages of a PDF read.
    """

    max_upload_bytes: int = 16 << 20
    max_chars: int = 1_000_000
    max_per_message: int = 8
    max_pdf_pages: int = 500

    def public(self) -> dict[str, int]:
        """The limits the page checks before uploading (``GET /api/config``)."""
        return {"max_upload_bytes": self.max_upload_bytes, "max_attachment_chars": self.max_chars,
                "max_attachments_per_message": self.max_per_message}


ATTACHMENT_LIMITS = AttachmentLimits()


@dataclass(frozen=True)
class Attachment:
    """One attached file's text, as stored in a user message.

    Attributes:
        name: the file's name (1-200 characters, no path, no control characters).
        kind: ``text``, ``markdown``, ``code``, ``csv``, ``json`` or ``pdf``.
        text: the extracted text (what the model reads).
        size: the file's size (bytes) as uploaded.
        pages: a PDF's page count (0 for other kinds).
    """

    name: str
    kind: str
    text: str
    size: int = 0
    pages: int = 0

    def to_json(self) -> dict[str, Any]:
        """The stored and exported shape: ``{"name", "kind", "text", "size", "pages"?}``."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "text": self.text, "size": self.size}
        if self.pages:
            out["pages"] = self.pages
        return out


def kind_of(name: str) -> str | None:
    """The kind a file name says (by its extension), or None for an unknown type."""
    base = name.rsplit("/", 1)[-1].lower()
    if base in _NAMED:
        return _NAMED[base]
    ext = base.rsplit(".", 1)[-1] if "." in base else ""
    if ext == "pdf":
        return "pdf"
    return TEXT_KINDS.get(ext)


def clean_name(name: str) -> str:
    """A file name fit to show and to put in the prompt: its last path part, control
    characters, quotes and angle brackets removed, at most 200 characters.

    Raises:
        GatewayError: ``invalid_request`` for a name left empty.
    """
    base = re.split(r"[\\/]", name)[-1]
    base = "".join(c for c in base if unicodedata.category(c)[0] != "C" and c not in '"<>')
    base = " ".join(base.split())[:200]
    if not base:
        raise GatewayError("invalid_request", "the file has no name")
    return base


def _decode_text(data: bytes, name: str) -> str:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    elif data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            pass
    if b"\x00" in data[:8192]:
        raise GatewayError("invalid_request", f"{name} looks like a binary file, not text; attach text, "
                           "Markdown, code, CSV, JSON or PDF files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        # not UTF-8: Windows-1252 (a superset of Latin-1's printable characters) is what
        # such text files nearly always are
        try:
            return data.decode("cp1252")
        except UnicodeDecodeError:
            raise GatewayError("invalid_request", f"{name} is not readable text (not UTF-8)") from None


def _pdf_text(data: bytes, name: str, max_pages: int) -> tuple[str, int]:
    """The text of a PDF's pages (pypdf's layout-free extraction), one page after another
    separated by a blank line, and the page count."""
    from pypdf import PdfReader  # imported on first use: most gateways never read a PDF
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                if not reader.decrypt(""):
                    raise GatewayError("invalid_request", f"{name} is protected by a password; attach an "
                                       "unprotected copy")
            except GatewayError:
                raise
            except Exception:
                raise GatewayError("invalid_request", f"{name} is encrypted and cannot be read") from None
        n = len(reader.pages)
        if n > max_pages:
            raise GatewayError("invalid_request", f"{name} has {n} pages; at most {max_pages} are read")
        pages = [(p.extract_text() or "").strip() for p in reader.pages]
    except GatewayError:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError, RecursionError):
        raise GatewayError("invalid_request", f"{name} is not a readable PDF") from None
    text = "\n\n".join(p for p in pages if p)
    if not text.strip():
        raise GatewayError("invalid_request", f"{name} has no text to read (a scanned PDF needs OCR first)")
    return text, n


def extract(name: str, data: bytes, limits: AttachmentLimits) -> Attachment:
    """Read an uploaded file into an attachment (runs in a worker thread: a PDF takes
    tens of milliseconds a page).

    Args:
        name: the file's name as the browser gives it (its extension says its kind).
        data: the file's bytes.
    Raises:
        GatewayError: ``invalid_request`` for an unknown type, an unreadable or empty
            file, or text over ``limits.max_chars``; ``frame_too_large`` over
            ``limits.max_upload_bytes``.
    """
    name = clean_name(name)
    kind = kind_of(name)
    if kind is None:
        raise GatewayError("invalid_request", f"{name}: this type of file cannot be attached; attach text, "
                           "Markdown, code, CSV, JSON or PDF files")
    if len(data) > limits.max_upload_bytes:
        raise GatewayError("frame_too_large", f"{name} is over the {limits.max_upload_bytes // (1 << 20)} MiB "
                           "limit for attachments")
    pages = 0
    if kind == "pdf":
        text, pages = _pdf_text(data, name, limits.max_pdf_pages)
    else:
        text = _decode_text(data, name)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        raise GatewayError("invalid_request", f"{name} is empty")
    if len(text) > limits.max_chars:
        raise GatewayError("invalid_request", f"{name} has {len(text):,} characters of text; at most "
                           f"{limits.max_chars:,} can be attached")
    return Attachment(name, kind, text, len(data), pages)


def parse_attachments(raw: Any, limits: AttachmentLimits) -> list[Attachment]:
    """Check the ``attachments`` of a ``chat`` or ``edit`` frame (or of an imported
    message): a list of ``{"name", "kind", "text", "size"?, "pages"?}``.

    Raises:
        GatewayError: ``invalid_request`` naming what is wrong.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise GatewayError("invalid_request", "'attachments' must be a list")
    if len(raw) > limits.max_per_message:
        raise GatewayError("invalid_request", f"at most {limits.max_per_message} attachments per message")
    out = []
    for a in raw:
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not isinstance(a.get("text"), str):
            raise GatewayError("invalid_request", "an attachment must be {\"name\", \"kind\", \"text\"}")
        name = clean_name(a["name"])
        kind = a.get("kind")
        if kind not in KINDS:
            raise GatewayError("invalid_request", f"{name}: unknown attachment kind {kind!r}")
        text = a["text"]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise GatewayError("invalid_request", f"{name}: the text is not valid Unicode") from None
        if not text.strip() or len(text) > limits.max_chars:
            raise GatewayError("invalid_request", f"{name}: the text must be 1-{limits.max_chars:,} characters")
        size, pages = a.get("size", 0), a.get("pages", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (size, pages)):
            raise GatewayError("invalid_request", f"{name}: 'size' and 'pages' must be integers >= 0")
        out.append(Attachment(name, kind, text, size, pages))
    return out


def prompt_content(content: str, attachments: list[dict[str, Any]] | None) -> str:
    """A user message as the model reads it: each attachment as

    ``<file name="NAME">`` newline, its text, newline ``</file>``,

    the files separated by a blank line and followed by a blank line and the typed
    message (which may be empty). A message without attachments is its content alone.
    A pure function of what is stored, so every turn renders a message's bytes the same
    and its KV is reused from the prefix cache.
    """
    if not attachments:
        return content
    files = "\n\n".join(f'<file name="{a["name"]}">\n{a["text"]}\n</file>' for a in attachments)
    return f"{files}\n\n{content}" if content else files


def estimate_tokens(text: str) -> int:
    """Tokens ``text`` takes at most, about (UTF-8 bytes / ``BYTES_PER_TOKEN``, rounded up)."""
    return math.ceil(len(text.encode("utf-8", "replace")) / BYTES_PER_TOKEN)
