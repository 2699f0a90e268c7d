"""Render the app's PNG icons from its SVG icons with headless Chromium (Playwright).

The web app manifest (static/manifest.webmanifest) names an SVG icon and PNGs of the sizes
Chromium and phones ask for: 192 and 512 px ("any"), 512 px maskable (the mark inside the
central 80% safe zone, full-bleed background) and a 180 px Apple touch icon. The PNGs are
committed; run this after changing an SVG:

    .venv/bin/python scripts/make_icons.py
"""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import sync_playwright

ICONS = Path(__file__).resolve().parents[1] / "static" / "icons"
CHROMIUM = "/usr/bin/chromium"
# (source SVG, output PNG, size in px)
RENDERS = [
    ("icon.svg", "icon-192.png", 192),
    ("icon.svg", "icon-512.png", 512),
    ("icon-maskable.svg", "icon-maskable-512.png", 512),
    ("icon-maskable.svg", "apple-touch-icon-180.png", 180),  # iOS rounds the corners itself
]


def main() -> None:
    """Write each PNG of ``RENDERS`` beside its SVG (transparent outside the shape)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        for svg, png, size in RENDERS:
            page = browser.new_page(viewport={"width": size, "height": size})
            page.set_content(f'<body style="margin:0;background:transparent">{(ICONS / svg).read_text()}</body>')
            page.locator("svg").evaluate("(s, n) => { s.setAttribute('width', n); s.setAttribute('height', n); }", size)
            page.locator("svg").screenshot(path=str(ICONS / png), omit_background=True)
            page.close()
            print(f"wrote {png} ({size}x{size})")
        browser.close()


if __name__ == "__main__":
    main()
