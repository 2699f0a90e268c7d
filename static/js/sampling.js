// Optional sampling parameters of the settings dialog (top_k, min_p,
// repetition_penalty, seed, stop) and the server's ranges for every numeric
// field. An empty field means "not set": the key is left out of `params`.

/** The optional numeric params, by the `data-param` of their inputs. */
export const OPTIONAL_PARAMS = ["top_k", "min_p", "repetition_penalty", "seed"];

/**
 * Set min/max of the dialog's number inputs from GET /api/config `ranges`
 * (`{name: {min, max, min_exclusive}}`, null meaning unbounded); inputs keep
 * their static limits when the gateway sends no ranges.
 * @param {HTMLElement} root
 * @param {Record<string, {min:number|null, max:number|null, min_exclusive?:boolean}>|undefined} ranges
 */
export function applyRanges(root, ranges) {
  if (!ranges) return;
  for (const input of root.querySelectorAll("input[data-param]")) {
    const r = ranges[input.dataset.param];
    if (!r) continue;
    if (typeof r.min === "number" && !r.min_exclusive && Math.abs(r.min) < 2 ** 53) input.min = String(r.min);
    if (typeof r.max === "number" && Math.abs(r.max) < 2 ** 53) input.max = String(r.max);
  }
}

/**
 * The optional params as the dialog shows them.
 * @param {HTMLElement} root  holds `input[data-param]` and `#set-stop`
 * @param {object} params  a chat's params (keys missing: fields left empty)
 */
export function fillOptional(root, params) {
  for (const input of root.querySelectorAll("input[data-param]")) {
    const v = params[input.dataset.param];
    input.value = typeof v === "number" ? String(v) : "";
  }
  const stop = params.stop;
  root.querySelector("#set-stop").value = Array.isArray(stop) ? stop.join("\n") : typeof stop === "string" ? stop : "";
}

/**
 * Read the optional params; unset ones are `null` (the caller removes them).
 * @param {HTMLElement} root
 * @returns {{params:object, error:string}}  `error` names a field that is not a whole number where one is needed
 */
export function readOptional(root) {
  const params = {};
  let error = "";
  for (const input of root.querySelectorAll("input[data-param]")) {
    const name = input.dataset.param;
    if (input.value.trim() === "") {
      params[name] = null;
      continue;
    }
    const v = Number(input.value);
    if ((name === "top_k" || name === "seed") && !Number.isSafeInteger(v)) {
      error = `${input.labels[0]?.textContent || name} must be a whole number`;
    }
    params[name] = v;
  }
  const stops = root.querySelector("#set-stop").value.split("\n").filter((s) => s.length > 0);
  params.stop = stops.length ? stops : null;
  return { params, error };
}

/**
 * `params` with every null value removed (the chat then uses the default).
 * @param {object} params
 * @returns {object}
 */
export function withoutUnset(params) {
  return Object.fromEntries(Object.entries(params).filter(([, v]) => v !== null && v !== undefined));
}
