"use strict";
// Displays the run data written by llamatrace/page.py; computes nothing about the model.
(function () {
  const D = JSON.parse(document.getElementById("run-data").textContent);
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
  const STAGE = Object.fromEntries(D.stages.map((s) => [s.id, s]));
  const EV = {};
  for (const e of D.events) EV[`${e.step}|${e.layer === null ? "m" : e.layer}|${e.stage}`] = e;
  const state = {view: D.start_view, layer: D.drawn_layer, step: D.start_step, stage: null, head: 0};
  const event = (id) => {
    const s = STAGE[id];
    return s ? EV[`${state.step}|${s.level === "model" ? "m" : state.layer}|${id}`] : undefined;
  };
  const shape = (a) => "[" + a.join(", ") + "]";
  const piece = (t) => JSON.stringify(t.piece).slice(1, -1);
  const allTokens = D.tokens.concat(D.generated);
  const tokenAt = (pos) => (pos < allTokens.length ? piece(allTokens[pos]) : "?");

  function half(h) {                     // IEEE float16 bits → number
    const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
    if (e === 31) return f ? NaN : s * Infinity;
    return s * Math.pow(2, e - 15) * (1 + f / 1024);
  }
  function bytes(ev) { return Uint8Array.from(atob(ev.values), (c) => c.charCodeAt(0)); }
  function values(ev) {
    const b = bytes(ev), v = new DataView(b.buffer), out = new Float64Array(ev.n);
    for (let i = 0; i < ev.n; i++) out[i] = half(v.getUint16(2 * i, true));
    return out;
  }

  // ---- header ---------------------------------------------------------------------------------
  const c = D.config;
  $("model").textContent = `— ${D.model}`;
  $("meta").innerHTML = `prompt “${esc(D.prompt)}” (${D.n_prompt} tokens, ${D.chat ? "chat template" : "raw"}) · ` +
    `dim ${c.dim} · ${c.n_layers} layers · ${c.n_heads} query / ${c.n_kv_heads} KV heads · KV cache ${D.max_seq} · ` +
    `values kept for layer${D.value_layers.length > 1 ? "s" : ""} ${D.value_layers.join(", ")} · llamatrace ${esc(D.version)}<br>` +
    `<code>${esc(D.command)}</code>` + (D.highlight_label ? ` · opened on <b>${esc(D.highlight_label)}</b>` : "");
  for (let l = 0; l < c.n_layers; l++) $("layer").add(new Option(String(l) + (D.value_layers.includes(l) ? " ●" : ""), l));
  for (let s = 0; s < D.steps; s++) {
    const label = s === 0 ? "0: prefill" : `${s}: decode “${piece(D.generated[s - 1])}”`;
    $("step").add(new Option(label, s));
  }
  $("layer").value = state.layer;
  $("step").value = state.step;
  $("view").value = state.view;

  function drawTokens() {
    const fed = state.step === 0 ? [0, D.n_prompt] : [D.n_prompt + state.step - 1, D.n_prompt + state.step];
    $("tokens").innerHTML = allTokens.map((t, i) =>
      `<span class="tok${i >= D.n_prompt ? " gen" : ""}${i >= fed[0] && i < fed[1] ? " fed" : ""}" ` +
      `data-pos="${i}" title="position ${i}, id ${t.id}">${esc(piece(t))}<small>${t.id}</small></span>`).join("");
    if (D.n_expert) for (const s of $("tokens").querySelectorAll(".tok")) s.addEventListener("click", () => route(+s.dataset.pos));
  }

  // ---- a token's route through the experts (mixture-of-experts models) --------------------------------
  function route(pos) {
    const step = pos < D.n_prompt ? 0 : pos - D.n_prompt + 1, R = D.routes[step] || {};
    const row = step === 0 ? pos : 0, P = $("panel");
    const layers = Object.keys(R).map(Number).sort((a, b) => a - b);
    if (!layers.length) { P.innerHTML = `<h2>route of “${esc(tokenAt(pos))}”</h2><p class="hint">not run (the last token is sampled, never fed)</p>`; return; }
    const body = layers.map((l) => {
      const ids = R[l].ids[row], w = (R[l].weights || [])[row] || [];
      return `<tr><th>layer ${l}</th>` + ids.map((e, j) =>
        `<td class="num" title="expert ${e}: weight ${w[j]}"><b>${e}</b> <span class="bar" style="display:inline-block;width:${Math.round(60 * (w[j] || 0))}px;height:8px;background:#d62728"></span> ${(w[j] || 0).toFixed(3)}</td>`).join("") + "</tr>";
    }).join("");
    P.innerHTML = `<h2 id="p-route">route of “${esc(tokenAt(pos))}” <small>position ${pos}, step ${step}</small></h2>` +
      `<p class="hint">the experts the router chose for this token in each layer (best first) and the weight of each one's output (top-${R[layers[0]].ids[row].length} of ${D.n_expert})</p>` +
      `<table class="route">${body}</table>`;
  }

  // ---- diagram ----------------------------------------------------------------------------------
  function weightNode(title) {            // "w_<stage id>_<weight name>" (diagram._weight_id) → [id, name]
    const s = D.stages.filter((x) => title.startsWith(`w_${x.id}_`)).sort((a, b) => b.id.length - a.id.length)[0];
    return s ? [s.id, title.slice(s.id.length + 3)] : null;
  }
  function nodeStage(g) {
    const t = g.querySelector("title").textContent;
    if (STAGE[t]) return t;
    const w = weightNode(t);
    if (w) return w[0];
    return {kv_cache: "cache_k", tokens: "inp_embd", sampled: "result_output"}[t] || null;
  }
  function showView() {
    const key = `${state.view}:${state.step}:${D.layer_kinds[state.layer]}`;
    const box = $("diagram");
    const src = document.querySelector(`#views .svg[data-key="${key}"]`);
    box.innerHTML = src.innerHTML;
    relabel(box);
    for (const g of box.querySelectorAll("g.node")) {
      const id = nodeStage(g);
      if (!id) continue;
      g.dataset.stage = id;
      g.addEventListener("click", () => select(id));
    }
    const kv = event("cache_k") || event("keys");
    $("kv-range").textContent = kv ? `KV cache at step ${state.step}: writes [${kv.start_pos}:${kv.start_pos + kv.seq_len}], ` +
      `reads [0:${kv.start_pos + kv.seq_len}] of ${D.max_seq}` : "";
    drawTokens();
    markSelected();
  }
  // The views are drawn for one layer of each kind (D.drawn_layers: DeltaNet or attention, with a
  // sliding window or not); the layers of a kind have the same stages and shapes: name the chosen one.
  function relabel(box) {
    const L = state.layer, W = D.weights[L] || {};
    if (L === D.drawn_layers[D.layer_kinds[L]]) return;
    const src = L === 0 ? "inputTensor (embedding)" : `output of layer ${L - 1}`;
    for (const t of box.querySelectorAll("text")) {
      t.textContent = t.textContent.replace(/\bblk\.\d+\./g, `blk.${L}.`).replace(/\b(Cache[KV])\[\d+\]/g, `$1[${L}]`)
        .replace(/\blayer \d+/g, `layer ${L}`).replace(/inputTensor \(embedding\)|output of layer \d+/, src);
    }
    for (const g of box.querySelectorAll("g.node")) {         // weight nodes: the layer's quant type
      const m = weightNode(g.querySelector("title").textContent);
      const w = m && (W[m[0]] || []).find((x) => x.name === m[1]);
      if (!w) continue;
      for (const t of g.querySelectorAll("text"))
        t.textContent = t.textContent.replace(/^\S+ (\[[\d, ]*\])/, `${w.type} $1`);
    }
  }
  function markSelected() {
    for (const g of $("diagram").querySelectorAll("g.node"))
      g.classList.toggle("sel", !!state.stage && g.dataset.stage === state.stage && g.querySelector("title").textContent === state.stage);
  }
  function order() {
    return D.stages.filter((s) => event(s.id) && (state.view === "model" || s.level === "layer"
      || $("diagram").querySelector(`g.node[data-stage="${s.id}"]`))).map((s) => s.id);
  }

  // ---- panel ------------------------------------------------------------------------------------
  function histogram(h) {
    if (!h) return "<p class='hint'>no finite values</p>";
    const w = 400, ht = 70, n = h.counts.length, top = Math.max(...h.counts) || 1;
    const bars = h.counts.map((k, i) => {
      const y = ht * k / top;
      return `<rect x="${(i * w / n).toFixed(1)}" y="${(ht - y).toFixed(1)}" width="${(w / n - 1).toFixed(1)}" height="${y.toFixed(1)}"><title>${k}</title></rect>`;
    }).join("");
    return `<svg class="hist" width="${w}" height="${ht + 14}" role="img" aria-label="histogram">${bars}` +
      `<text x="0" y="${ht + 12}" font-size="10">${h.lo.toPrecision(4)}</text>` +
      `<text x="${w}" y="${ht + 12}" font-size="10" text-anchor="end">${h.hi.toPrecision(4)}</text></svg>`;
  }
  function weightsTable(s) {
    const ws = (D.weights[s.level === "model" ? "m" : state.layer] || {})[s.id] || [];
    if (!ws.length) return "";
    return "<h3>weights</h3><table>" + ws.map((w) =>
      `<tr><td>${esc(w.name)}</td><td class="num">${esc(w.gguf)}${w.tied ? " (tied)" : ""}</td><td>${esc(w.type)}</td>` +
      `<td class="num">${shape(w.shape)}</td></tr>`).join("") + "</table>";
  }
  function attention(ev) {
    const [nh, rows, cols] = ev.shape, kept = ev.values ? Math.min(nh, Math.floor(ev.n / (rows * cols))) : 0;
    if (!ev.values) return "";
    if (!kept) return `<h3>attention</h3><p class="hint" id="attn-none">one head's map has ${rows * cols} values, ` +
      `more than the ${ev.n} the page keeps: see it with <code>llamatrace attention --layer ${state.layer}</code></p>`;
    const v = values(ev), h = Math.min(state.head, kept - 1);
    let opts = "";
    for (let i = 0; i < kept; i++) opts += `<option value="${i}"${i === h ? " selected" : ""}>${i}</option>`;
    let body = "";
    for (let r = 0; r < rows; r++) {
      const q = ev.start_pos + r;
      let cells = "", sum = 0;
      for (let k = 0; k < cols; k++) {
        const p = v[(h * rows + r) * cols + k];
        sum += p;
        const a = Math.min(1, Math.sqrt(p));
        cells += `<td data-p="${p}" style="background:rgba(214,39,40,${a.toFixed(3)})" title="query ${esc(tokenAt(q))} → key ${esc(tokenAt(k))}: ${p.toFixed(4)}"></td>`;
      }
      body += `<tr><th>${esc(tokenAt(q))}</th>${cells}<td class="sum">Σ ${sum.toFixed(3)}</td></tr>`;
    }
    const cut = kept < nh ? ` (heads 0–${kept - 1} of ${nh}: the page keeps the first ${ev.n} values; ` +
      `all heads: <code>llamatrace attention --layer ${state.layer}</code>)` : "";
    return `<h3>attention of head <select id="head">${opts}</select></h3>` +
      `<p class="hint">rows: query tokens; columns: key positions 0…${cols - 1}; colour: √probability${cut}</p>` +
      `<table class="attn" id="attn">${body}</table>`;
  }
  function topk() {
    const t = D.top[state.step];
    if (!t) return "";
    return "<h3>next token (softmax of the last row)</h3><table>" + t.map((x) =>
      `<tr><td class="num">${x.id}</td><td class="num">${esc(JSON.stringify(x.piece))}</td><td class="num">${(100 * x.p).toFixed(2)}%</td></tr>`).join("") + "</table>";
  }
  function select(id) {
    state.stage = id;
    const s = STAGE[id], ev = event(id), P = $("panel");
    markSelected();
    if (!ev) { P.innerHTML = `<h2>${esc(id)}</h2><p class="hint">not run at this step</p>`; return; }
    const st = ev.stats;
    const where = s.level === "model" ? "model level" : `layer ${state.layer}`;
    let out = `<h2 id="p-id">${esc(s.id)} <small>${esc(s.op)}</small></h2>` +
      `<table><tr><td>where</td><td>${where}, step ${state.step} (start_pos ${ev.start_pos}, seq_len ${ev.seq_len})</td></tr>` +
      `<tr><td>chapter</td><td><i>${esc(s.chapter)}</i> · §${esc(s.section)} · STAGE ${s.book_stage}: ${esc(s.book_title)}</td></tr>` +
      `<tr><td>llama.cpp</td><td class="num">${esc(s.llama_cpp || "—")}${s.llama_cpp_note ? ` <span class="hint">(${esc(s.llama_cpp_note)})</span>` : ""}</td></tr>` +
      `<tr><td>shape</td><td class="num" id="p-shape">${shape(ev.shape)} ${esc(ev.dtype)}</td></tr></table>` +
      `<p class="desc">${esc(s.description)}</p><h3>statistics</h3><table class="num">` +
      ["rms", "mean", "min", "max", "sum", "abs_max"].map((k) => `<tr><td>${k}</td><td id="p-${k}">${esc(st[k])}</td></tr>`).join("") +
      `<tr><td>NaN / Inf</td><td>${st.nan} / ${st.inf}</td></tr></table>` + histogram(ev.hist);
    if (ev.values) {
      const v = values(ev), total = ev.shape.reduce((a, b) => a * b, 1);
      out += `<h3>first values</h3><div class="values">${Array.from(v.slice(0, 24), (x) => x.toPrecision(4)).join(", ")}` +
        `${ev.n > 24 ? ", …" : ""}</div><p class="hint">${ev.n < total ? `the first ${ev.n} of ${total} values` : `all ${total} values`} are in the page (float16)</p>` +
        `<button id="save">save .npy</button>`;
    } else {
      out += `<p class="hint">values are kept for layer${D.value_layers.length > 1 ? "s" : ""} ${D.value_layers.join(", ")} (choose with --layer)</p>`;
    }
    out += weightsTable(s);
    if (s.id === "kq_soft_max") out += attention(ev);
    if (s.id === "result_output") out += topk();
    P.innerHTML = out;
    if ($("save")) $("save").addEventListener("click", () => save(ev, s));
    if ($("head")) $("head").addEventListener("change", (e) => { state.head = +e.target.value; select(id); });
  }
  function save(ev, s) {
    const total = ev.shape.reduce((a, b) => a * b, 1);
    const dims = ev.n < total ? [ev.n] : ev.shape;
    let header = `{'descr': '<f2', 'fortran_order': False, 'shape': (${dims.join(", ")}${dims.length === 1 ? "," : ""}), }`;
    header += " ".repeat(63 - ((10 + header.length) % 64)) + "\n";
    const head = new Uint8Array(10 + header.length);
    head.set([0x93, 78, 85, 77, 80, 89, 1, 0, header.length & 0xff, header.length >> 8]);
    for (let i = 0; i < header.length; i++) head[10 + i] = header.charCodeAt(i);
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([head, bytes(ev)], {type: "application/octet-stream"}));
    a.download = `step${ev.step}.${s.level === "model" ? "" : `layer${state.layer}.`}${s.id}.npy`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  // ---- controls -----------------------------------------------------------------------------------
  const refresh = () => { showView(); if (state.stage) select(state.stage); };
  $("view").addEventListener("change", (e) => { state.view = e.target.value; refresh(); });
  $("layer").addEventListener("change", (e) => { state.layer = +e.target.value; refresh(); });
  $("fit").addEventListener("change", (e) => $("diagram").classList.toggle("fit", e.target.checked));
  $("diagram").classList.add("fit");
  $("step").addEventListener("change", (e) => { state.step = +e.target.value; refresh(); });
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "SELECT" || !["ArrowDown", "ArrowUp", "j", "k"].includes(e.key)) return;
    const ids = order();
    if (!ids.length) return;
    const i = ids.indexOf(state.stage), down = e.key === "ArrowDown" || e.key === "j";
    select(ids[i < 0 ? 0 : (i + (down ? 1 : ids.length - 1)) % ids.length]);
    const g = $("diagram").querySelector(`g.node.sel`);
    if (g) g.scrollIntoView({block: "nearest", inline: "nearest"});
    e.preventDefault();
  });
  showView();
  if (D.highlight.length) select(D.stages.find((s) => D.highlight.includes(s.id)).id);
  window.llamatrace = {state, select, route, data: D};
})();
