"""The API docs at /docs, served offline: nothing is loaded from another host.

With Swagger UI 5 installed as a Python package (`swagger-ui-bundle-v2`, whose module is
`swagger_ui_bundle`), /docs is Swagger UI from its files, served at /docs/assets. Without it, /docs
is a small page of this module: every operation of /openapi.json with its parameters and body,
an API key field (sent as `Authorization: Bearer`), and a form to try each call.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"
_SWAGGER_5 = re.compile(r"swagger-ui-(\d+)\.")


def swagger_assets() -> Path | None:
    """The directory of an installed Swagger UI 5 (earlier ones cannot read OpenAPI 3.1)."""
    try:
        module = importlib.import_module("swagger_ui_bundle")
    except ImportError:
        return None
    path = Path(str(getattr(module, "swagger_ui_path", "")))
    major = _SWAGGER_5.match(path.name)
    if not major or int(major.group(1)) < 5 or not (path / "swagger-ui-bundle.js").is_file():
        return None
    return path


def add_docs(app: FastAPI) -> None:
    """Serve /docs (the app is built with docs_url=None, redoc_url=None: FastAPI's own pages load
    their scripts from a CDN and are blank offline)."""
    assets = swagger_assets()
    title = f"{app.title} {app.version}: API docs"
    if assets is not None:
        app.mount(ASSETS, StaticFiles(directory=assets), name="swagger-ui")

        @app.get("/docs", include_in_schema=False)
        def swagger() -> HTMLResponse:
            return get_swagger_ui_html(
                openapi_url=app.openapi_url or "/openapi.json", title=title,
                swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS}/swagger-ui.css",
                swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
                swagger_ui_parameters={"persistAuthorization": True})
        return

    page = PAGE.replace("{{TITLE}}", title).replace("{{OPENAPI}}", app.openapi_url or "/openapi.json")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(page)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{TITLE}}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:15px/1.45 system-ui,sans-serif;margin:0 auto;max-width:980px;padding:1em;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
details{border:1px solid #ddd;border-radius:6px;margin:.4em 0;padding:.3em .6em}
summary{cursor:pointer}.m{display:inline-block;min-width:4.5em;font-weight:bold}
.get{color:#1a7f37}.post{color:#0969da}.patch{color:#9a6700}.delete{color:#cf222e}
code,pre,textarea,input{font:13px ui-monospace,monospace}pre{background:#f6f8fa;padding:.6em;overflow:auto}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:.2em .5em;text-align:left}
textarea{width:100%;height:8em}#auth{background:#f6f8fa;padding:.6em;border-radius:6px}
</style></head><body>
<h1>{{TITLE}}</h1>
<p>The OpenAPI document: <a href="{{OPENAPI}}">{{OPENAPI}}</a>. This page is served offline; with
the <code>swagger-ui-bundle-v2</code> package installed, /docs is Swagger UI.</p>
<div id="auth"><label>API key (sent as <code>Authorization: Bearer &lt;key&gt;</code>; none with
<code>--no-auth</code>): <input id="key" type="password" size="60" autocomplete="off"></label></div>
<div id="api">Loading {{OPENAPI}} ...</div>
<script>
"use strict";
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
};
const keyBox = document.getElementById("key");
keyBox.value = sessionStorage.getItem("engram-key") || "";
keyBox.addEventListener("input", () => sessionStorage.setItem("engram-key", keyBox.value));
const ref = (spec, s) => s && s.$ref ? spec.components.schemas[s.$ref.split("/").pop()] : s;
function example(spec, schema, depth = 0) {
  schema = ref(spec, schema) || {};
  if (depth > 4) return null;
  if (schema.default !== undefined) return schema.default;
  if (schema.anyOf) return example(spec, schema.anyOf.find(s => s.type !== "null") || {}, depth + 1);
  if (schema.type === "object" || schema.properties) {
    const out = {};
    for (const name of schema.required || []) out[name] = example(spec, schema.properties[name], depth + 1);
    return out;
  }
  if (schema.type === "array") return [];
  if (schema.type === "integer" || schema.type === "number") return schema.minimum || 0;
  if (schema.type === "boolean") return false;
  return schema.type === "string" ? "" : null;
}
function operation(spec, path, method, op) {
  const params = op.parameters || [];
  const inputs = {};
  const rows = params.map(p => {
    const input = el("input", {size: "40", placeholder: p.in});
    inputs[p.name] = [p, input];
    const where = p.in + (p.required ? ", required" : "");
    return el("tr", {}, el("td", {}, el("code", {}, p.name)), el("td", {}, where),
              el("td", {}, input), el("td", {}, (p.description || "")));
  });
  const body = op.requestBody && op.requestBody.content;
  const json = body && body["application/json"];
  const text = el("textarea");
  if (json) text.value = JSON.stringify(example(spec, json.schema), null, 2);
  else if (body) text.value = "";
  const out = el("pre", {}, "");
  const send = el("button", {}, "Send");
  send.addEventListener("click", async () => {
    let url = path, query = new URLSearchParams();
    for (const [name, [p, input]] of Object.entries(inputs)) {
      if (!input.value) continue;
      if (p.in === "path") url = url.replace("{" + name + "}", encodeURIComponent(input.value));
      else if (p.in === "query") query.append(name, input.value);
    }
    const headers = {};
    if (keyBox.value) headers["Authorization"] = "Bearer " + keyBox.value;
    if (body) headers["Content-Type"] = json ? "application/json" : Object.keys(body)[0];
    out.textContent = "...";
    try {
      const r = await fetch(url + (query.toString() ? "?" + query : ""),
                            {method: method.toUpperCase(), headers, body: body ? text.value : undefined});
      const raw = await r.text();
      let shown = raw;
      try { shown = JSON.stringify(JSON.parse(raw), null, 2); } catch (e) {}
      out.textContent = r.status + " " + r.statusText + "\\n" + shown;
    } catch (e) { out.textContent = String(e); }
  });
  const summary = el("summary", {}, el("span", {class: "m " + method}, method.toUpperCase()), " ",
                     el("code", {}, path), " ", op.summary || "");
  const parts = [summary, el("p", {}, op.description || "")];
  if (rows.length) parts.push(el("table", {}, el("tr", {}, el("th", {}, "parameter"), el("th", {}, "in"),
                                                  el("th", {}, "value"), el("th", {}, "")), ...rows));
  if (body) parts.push(el("p", {}, "Body (" + Object.keys(body).join(", ") + "):"), text);
  parts.push(send, out);
  return el("details", {}, ...parts);
}
fetch("{{OPENAPI}}").then(r => r.json()).then(spec => {
  const api = document.getElementById("api");
  api.textContent = "";
  api.append(el("p", {}, spec.info.summary || "", " ", spec.info.description || ""));
  const byTag = {};
  for (const [path, ops] of Object.entries(spec.paths))
    for (const [method, op] of Object.entries(ops))
      (byTag[(op.tags || ["other"])[0]] ||= []).push([path, method, op]);
  for (const [tag, ops] of Object.entries(byTag)) {
    api.append(el("h2", {}, tag));
    for (const [path, method, op] of ops) api.append(operation(spec, path, method, op));
  }
}).catch(e => { document.getElementById("api").textContent = "Cannot load the API: " + e; });
</script></body></html>
"""
