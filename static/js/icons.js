// The page's icons: one table of SVG path data (24x24 box, stroked) and the function
// that builds an icon from it. A leaf module: it imports nothing, so every view can
// use it without import circles.

const SVG_NS = "http://www.w3.org/2000/svg";

/** Path data ("d" attribute) of each icon, by name. */
export const ICONS = Object.freeze({
  copy: "M9 9h10v10H9zM5 15V5h10",
  check: "M5 12l5 5 9-10",
  regenerate: "M20 11a8 8 0 1 0-2.3 5.7M20 5v6h-6",
  edit: "M4 20h4L19 9l-4-4L4 16zM13.5 6.5l4 4",
  prev: "M15 6l-6 6 6 6",
  next: "M9 6l6 6-6 6",
  more: "M5 12h14M13 6l6 6-6 6",
  trash: "M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3",
});

/**
 * A small stroked icon, built with DOM calls (decorative: hidden from assistive
 * technology; the button that holds it carries the label).
 * @param {Document} doc
 * @param {string} pathData  an `ICONS` value (or any SVG path "d" in a 24x24 box)
 * @returns {SVGSVGElement}
 */
export function icon(doc, pathData) {
  const svg = doc.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("class", "icon");
  const path = doc.createElementNS(SVG_NS, "path");
  path.setAttribute("d", pathData);
  svg.append(path);
  return svg;
}
