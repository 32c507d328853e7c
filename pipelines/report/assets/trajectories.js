// PyVision trajectory browser: everything is in the JSON data element; no network.
// Text from models is inserted with textContent only (never as HTML).
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const PAGE = 200;
  const S = {tab: "eval", model: "", bench: "", verdict: "", stop: "", tools: "", q: "", a: "", b: "",
             open: "", cmp: "", run: "", step: "", status: "", shown: PAGE};
  const KEYS = Object.keys(S).filter(k => k !== "shown");

  // -- helpers -------------------------------------------------------------------------------
  function el(tag, attrs, ...kids) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") n.className = v;
      else if (k === "text") n.textContent = v;
      else if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
      else n.setAttribute(k, v === true ? "" : v);
    }
    for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false)
      n.appendChild(typeof k === "string" ? document.createTextNode(k) : k);
    return n;
  }
  const src = sha => D.media_dir + "/" + sha + D.media_ext;
  function img(sha, label, cls) {
    if (!sha) return el("span", {class: "note", text: "(" + (label || "image") + " not stored)"});
    return el("a", {href: src(sha), target: "_blank", title: label || ""},
              el("img", {loading: "lazy", src: src(sha), alt: label || "image", class: cls}));
  }
  const pct = x => (x === null || x === undefined) ? "-" : (Math.round(x * 1000) / 10) + "%";
  const num = (x, d) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d === undefined ? 3 : d);
  // One line in the list: a long answer (a model that rambles inside <answer>) is cut; the
  // sample's own view shows it whole.
  const clip = (t, n = 60) => { t = String(t).replace(/\s+/g, " "); return t.length > n ? t.slice(0, n - 1) + "…" : t; };
  const entryKey = e => D.models[e.m].key + "|" + D.samples[e.s].benchmark + "|" + D.samples[e.s].id;
  const modelIdx = key => D.models.findIndex(m => m.key === key);
  function badge(v) { return el("span", {class: "v v-" + v, text: v}); }

  const PY = /(#[^\n]*)|("""[\s\S]*?"""|'''[\s\S]*?'''|[rbfu]{0,2}"(?:\\.|[^"\\\n])*"|[rbfu]{0,2}'(?:\\.|[^'\\\n])*')|\b(\d+(?:\.\d+)?(?:e[-+]?\d+)?)\b|\b(and|as|assert|break|class|continue|def|del|elif|else|except|False|finally|for|from|global|if|import|in|is|lambda|None|nonlocal|not|or|pass|raise|return|True|try|while|with|yield)\b|\b([A-Za-z_][A-Za-z0-9_]*)(?=\()/g;
  const TOK = ["tok-com", "tok-str", "tok-num", "tok-kw", "tok-fn"];
  function code(text) {
    const pre = el("pre", {class: "code"});
    let last = 0, m;
    PY.lastIndex = 0;
    while ((m = PY.exec(text)) !== null) {
      if (m.index > last) pre.appendChild(document.createTextNode(text.slice(last, m.index)));
      const g = [1, 2, 3, 4, 5].find(i => m[i] !== undefined);
      pre.appendChild(el("span", {class: TOK[g - 1], text: m[0]}));
      last = m.index + m[0].length;
      if (m[0].length === 0) PY.lastIndex++;
    }
    if (last < text.length) pre.appendChild(document.createTextNode(text.slice(last)));
    return pre;
  }

  // -- state <-> URL -------------------------------------------------------------------------
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    for (const k of KEYS) S[k] = p.get(k) || (k === "tab" ? "eval" : "");
    S.shown = PAGE;
  }
  function writeHash() {
    const p = new URLSearchParams();
    for (const k of KEYS) if (S[k] && !(k === "tab" && S[k] === "eval")) p.set(k, S[k]);
    history.replaceState(null, "", "#" + p.toString());
  }
  function set(changes) { Object.assign(S, changes); if (!("shown" in changes)) S.shown = PAGE; writeHash(); render(); }

  // -- evaluation rows -----------------------------------------------------------------------
  function searchText(e) {
    if (e._q === undefined) {
      const s = D.samples[e.s];
      e._q = [s.id, s.question, s.gold, e.prediction || "", e.stop,
              ...e.steps.map(t => [t.text, t.code || "", t.out || "", t.err || "", t.after || ""].join(" "))]
        .join("\n").toLowerCase();
    }
    return e._q;
  }
  function toolsMatch(n) {
    if (!S.tools) return true;
    return S.tools.endsWith("+") ? n >= parseInt(S.tools) : n === parseInt(S.tools);
  }
  function evalRows() {
    let rows;
    if (S.a && S.b) {
      const ia = modelIdx(S.a), ib = modelIdx(S.b), pairs = new Map();
      for (const e of D.entries) {
        if (e.m !== ia && e.m !== ib) continue;
        const p = pairs.get(e.s) || {};
        p[e.m === ia ? "a" : "b"] = e;
        pairs.set(e.s, p);
      }
      rows = [];
      for (const p of pairs.values()) {
        if (!p.a || !p.b || p.a.verdict === p.b.verdict) continue;
        const change = p.b.verdict === "right" ? "fixed" : p.a.verdict === "right" ? "broken" : "changed";
        rows.push({e: p.b, other: p.a, change});
      }
    } else {
      const im = S.model ? modelIdx(S.model) : -1;
      rows = D.entries.filter(e => im < 0 || e.m === im).map(e => ({e}));
    }
    const q = S.q.trim().toLowerCase();
    return rows.filter(({e}) => (!S.bench || D.samples[e.s].benchmark === S.bench)
      && (!S.verdict || e.verdict === S.verdict) && (!S.stop || e.stop === S.stop)
      && toolsMatch(e.tools) && (!q || searchText(e).includes(q)));
  }

  // -- header and filters --------------------------------------------------------------------
  function options(values, current, all) {
    return [el("option", {value: "", text: all}),
            ...values.map(v => el("option", {value: v[0], text: v[1], selected: v[0] === current}))];
  }
  function select(label, key, values, all, cls) {
    return el("label", {class: cls}, label,
              el("select", {"data-key": key, onchange: ev => set({[key]: ev.target.value, open: ""})},
                 options(values, S[key], all)));
  }
  function header() {
    const nRoll = D.steps.reduce((a, s) => a + s.groups.length, 0);
    return el("header", {},
      el("h1", {text: document.getElementById("app").dataset.title}),
      el("span", {class: "tabs"},
        el("button", {class: S.tab === "eval" ? "on" : "", onclick: () => set({tab: "eval", open: ""}),
                      text: "Evaluation (" + D.entries.length + ")"}),
        el("button", {class: S.tab === "rollouts" ? "on" : "", onclick: () => set({tab: "rollouts", open: ""}),
                      text: "Training rollouts (" + nRoll + " groups)"})),
      el("span", {text: "runs: " + D.runs.join(", ")}));
  }
  function evalFilters(count) {
    const models = D.models.map(m => [m.key, m.key]);
    const stops = [...new Set(D.entries.map(e => e.stop))].sort().map(s => [s, s]);
    const search = el("input", {type: "search", placeholder: "question, answer, code, output", value: S.q,
                                "data-key": "q"});
    search.addEventListener("input", ev => { S.q = ev.target.value; S.shown = PAGE; writeHash(); renderList(); });
    return el("div", {class: "filters"},
      select("model", "model", models, "all"),
      select("benchmark", "bench", D.benchmarks.map(b => [b, b]), "all"),
      select("verdict", "verdict", [["right", "right"], ["wrong", "wrong"], ["partial", "partial"], ["unscored", "unscored"]], "all"),
      select("stop reason", "stop", stops, "all"),
      select("tool calls", "tools", [["0", "0"], ["1", "1"], ["2", "2"], ["3+", "3 or more"]], "any"),
      el("label", {}, "search", search),
      el("span", {class: "changed"},
        select("verdict changed from", "a", models, "-"),
        select("to", "b", models, "-")),
      el("span", {class: "count", id: "count", text: count}));
  }

  // -- list ----------------------------------------------------------------------------------
  function rowThumb(sample, e) {
    const first = sample.inputs.find(x => x) || (e && e.steps.flatMap(t => t.imgs || []).find(x => x));
    return first ? el("img", {loading: "lazy", src: src(first), alt: ""})
                 : el("span", {class: "noimg", text: sample.video ? "video" : "no image"});
  }
  function renderList() {
    const list = document.getElementById("list");
    list.textContent = "";
    if (S.tab === "rollouts") return renderGroupList(list);
    const rows = evalRows();
    document.getElementById("count").textContent = rows.length + " of " + D.entries.length +
      (S.a && S.b ? " (samples whose verdict changed)" : " samples");
    if (!rows.length) { list.appendChild(el("div", {class: "empty", text: "No sample matches these filters."})); return; }
    for (const r of rows.slice(0, S.shown)) {
      const e = r.e, s = D.samples[e.s], key = entryKey(e);
      list.appendChild(el("div", {class: "row" + (S.open === key ? " sel" : ""), "data-key": key,
                                  onclick: () => set({open: key, shown: S.shown})},
        rowThumb(s, e),
        el("div", {class: "body"},
          el("div", {class: "q", text: s.question.split("\n")[0]}),
          el("div", {class: "meta"},
            r.change ? el("span", {class: "chg chg-" + r.change,
                                   text: r.change + ": " + r.other.verdict + " → " + e.verdict}) : badge(e.verdict),
            el("span", {text: D.models[e.m].key}), el("span", {text: s.benchmark + " #" + s.id}),
            el("span", {text: "answer " + (e.prediction === null ? "none" : clip(e.prediction)) + " / gold " + clip(s.gold)}),
            el("span", {text: e.tools + " tool calls"}), el("span", {text: e.stop})))));
    }
    if (rows.length > S.shown)
      list.appendChild(el("button", {class: "more", onclick: () => set({shown: S.shown + PAGE}),
                                     text: "show " + Math.min(PAGE, rows.length - S.shown) + " more"}));
  }

  // -- one sample, side by side --------------------------------------------------------------
  function turnsView(steps, prefix) {
    const out = [];
    steps.forEach((t, i) => {
      const turn = el("div", {class: "turn"}, el("div", {class: "who", text: prefix + "model, turn " + (i + 1)}));
      if (t.text) turn.appendChild(el("div", {class: "text", text: t.text}));
      if (t.code !== undefined) {
        turn.appendChild(code(t.code));
        const box = el("div", {class: "interp" + (t.status === "ok" ? "" : " err")},
          el("div", {class: "who", text: "interpreter: " + t.status + " (" + t.tool_s + " s)" + (t.truncated ? ", output truncated" : "")}));
        if (t.out) box.appendChild(el("pre", {text: t.out}));
        if (t.err) box.appendChild(el("pre", {text: t.err}));
        if (t.imgs && t.imgs.length) box.appendChild(el("div", {class: "thumbs"}, t.imgs.map((x, k) => img(x, "interpreter image " + (k + 1), "interp-img"))));
        turn.appendChild(box);
        if (t.after) turn.appendChild(el("div", {class: "text", text: t.after}));
      }
      out.push(turn);
    });
    return out;
  }
  function stats(pairs) {
    return el("dl", {class: "stats"}, pairs.flatMap(([k, v]) => [el("dt", {text: k}), el("dd", {text: String(v)})]));
  }
  function entryColumn(e, change) {
    const s = D.samples[e.s];
    return el("div", {class: "col", "data-model": D.models[e.m].key},
      el("h3", {}, D.models[e.m].key, badge(e.verdict), change ? el("span", {class: "chg chg-" + change, text: change}) : null),
      stats([["answer", e.prediction === null ? "(none)" : e.prediction], ["gold", s.gold],
             ["score", (e.metric || "-") + " = " + num(e.score)],
             ["scored by", e.scored_by + " (" + e.scorer + ")"],
             ["turns", e.turns], ["tool calls", e.tools + (e.failed ? " (" + e.failed + " failed)" : "")],
             ["visual tokens", e.visual], ["tokens", e.tokens], ["stop reason", e.stop],
             ["time", e.seconds + " s"], ["prompt", e.prompt]]),
      turnsView(e.steps, ""),
      el("div", {class: "answer", text: "final answer: " + (e.prediction === null ? "(none)" : e.prediction) + "  ·  gold: " + s.gold + "  ·  " + e.verdict}));
  }
  function samplePanel(s, shownEntries) {
    const opts = s.options.length ? s.options.map((o, i) => "(" + String.fromCharCode(65 + i) + ") " + o).join("   ") : "";
    const gold = s.gold + (s.options.length && /^[A-Z]$/.test(s.gold) ? " (" + (s.options[s.gold.charCodeAt(0) - 65] || "?") + ")" : "");
    const panel = el("div", {class: "sample"},
      el("h2", {text: s.benchmark + " · sample " + s.id}),
      el("p", {class: "question", text: s.question}),
      opts && !s.question.includes(s.options[0]) ? el("div", {class: "gold", text: opts}) : null,
      el("div", {class: "gold"}, el("b", {text: "gold: "}), gold));
    if (s.video) {
      panel.appendChild(el("div", {class: "note", text: "video " + s.video + ": the model sees only the frames its code sampled"}));
      for (const e of shownEntries) {
        const frames = e.steps.flatMap(t => t.imgs || []);
        panel.appendChild(el("div", {}, el("b", {text: D.models[e.m].key + ": "}),
          frames.length ? el("span", {}, frames.length + " frame(s) sampled")
                        : el("span", {class: "note", text: "the code sampled no frames (" + e.visual + " visual tokens)"})));
        if (frames.length) panel.appendChild(el("div", {class: "thumbs"}, frames.map((x, k) => img(x, "frame " + (k + 1), "input-img"))));
      }
    }
    if (s.inputs.length) panel.appendChild(el("div", {class: "thumbs"}, s.inputs.map((x, k) => img(x, "input image " + (k + 1), "input-img"))));
    else if (!s.video) panel.appendChild(el("div", {class: "note", text: "no input image stored"}));
    return panel;
  }
  function renderEvalDetail(box) {
    const [mk, bench, ...rest] = S.open.split("|");
    const sid = rest.join("|");
    const same = D.entries.filter(e => D.samples[e.s].benchmark === bench && D.samples[e.s].id === sid);
    const main = same.find(e => D.models[e.m].key === mk);
    if (!main) { box.appendChild(el("div", {class: "empty", text: "This sample is not in the page."})); return; }
    const extra = new Set(S.cmp ? S.cmp.split(",") : []);
    if (S.a && S.b) { extra.add(S.a); extra.add(S.b); }
    const shown = same.filter(e => e === main || extra.has(D.models[e.m].key));
    const change = (S.a && S.b) ? (() => {
      const a = same.find(e => D.models[e.m].key === S.a), b = same.find(e => D.models[e.m].key === S.b);
      if (!a || !b || a.verdict === b.verdict) return null;
      return b.verdict === "right" ? "fixed" : a.verdict === "right" ? "broken" : "changed";
    })() : null;
    box.appendChild(samplePanel(D.samples[main.s], shown));
    if (same.length > 1) {
      box.appendChild(el("div", {class: "compare"}, el("b", {text: "side by side:"}),
        same.filter(e => e !== main).map(e => {
          const key = D.models[e.m].key;
          return el("label", {}, el("input", {type: "checkbox", checked: extra.has(key), "data-model": key,
            onchange: ev => { const c = new Set(S.cmp ? S.cmp.split(",") : []);
                              ev.target.checked ? c.add(key) : c.delete(key);
                              set({cmp: [...c].join(","), shown: S.shown}); }}), key + " ", badge(e.verdict));
        }),
        el("button", {onclick: () => set({cmp: same.map(e => D.models[e.m].key).join(","), shown: S.shown}), text: "all"})));
    }
    box.appendChild(el("div", {class: "cols"}, shown.map(e => entryColumn(e, e === main ? change : null))));
  }
  function summary(box) {
    box.appendChild(el("p", {class: "note", text: "Pick a sample on the left. Filters and the opened sample are kept in the address, so a link shows the same view."}));
    const t = el("table", {class: "groups"}, el("tr", {}, ["model", "benchmark", "samples", "right", "partial", "wrong", "unscored", "mean tool calls", "mean visual tokens"].map(h => el("th", {text: h}))));
    const agg = new Map();
    for (const e of D.entries) {
      const k = e.m + "|" + D.samples[e.s].benchmark;
      const a = agg.get(k) || {m: e.m, b: D.samples[e.s].benchmark, n: 0, right: 0, partial: 0, wrong: 0, unscored: 0, tools: 0, vis: 0};
      a.n++; a[e.verdict]++; a.tools += e.tools; a.vis += e.visual; agg.set(k, a);
    }
    for (const a of agg.values())
      t.appendChild(el("tr", {}, el("td", {}, el("a", {href: "#", onclick: ev => { ev.preventDefault(); set({model: D.models[a.m].key, bench: a.b}); }, text: D.models[a.m].key})),
        [a.b, a.n, a.right, a.partial, a.wrong, a.unscored, (a.tools / a.n).toFixed(2), (a.vis / a.n).toFixed(0)].map(v => el("td", {text: String(v)}))));
    box.appendChild(t);
  }

  // -- training rollouts ---------------------------------------------------------------------
  function groupRows() {
    const q = S.q.trim().toLowerCase(), rows = [];
    for (const st of D.steps) {
      if (S.run && st.run !== S.run) continue;
      if (S.step !== "" && String(st.step) !== S.step) continue;
      for (const g of st.groups) {
        if (S.status === "kept" && g.status !== "kept") continue;
        if (S.status === "dropped" && g.status === "kept") continue;
        if (S.status && !["kept", "dropped"].includes(S.status) && g.status !== S.status) continue;
        if (q && !(g.task_id + "\n" + g.question).toLowerCase().includes(q)) continue;
        rows.push({st, g, key: st.run + "|" + st.step + "|" + g.group});
      }
    }
    return rows;
  }
  function rolloutFilters(count) {
    const runs = [...new Set(D.steps.map(s => s.run))].map(r => [r, r]);
    const steps = [...new Set(D.steps.filter(s => !S.run || s.run === S.run).map(s => String(s.step)))].map(s => [s, "step " + s]);
    const statuses = [...new Set(D.steps.flatMap(s => s.groups.map(g => g.status)))].sort();
    const search = el("input", {type: "search", placeholder: "task or question", value: S.q});
    search.addEventListener("input", ev => { S.q = ev.target.value; writeHash(); renderList(); });
    return el("div", {class: "filters"},
      select("run", "run", runs, "all"), select("step", "step", steps, "all"),
      select("groups", "status", [["kept", "kept"], ["dropped", "dropped (any reason)"], ...statuses.filter(s => s !== "kept").map(s => [s, "dropped: " + s])], "all"),
      el("label", {}, "search", search), el("span", {class: "count", id: "count", text: count}));
  }
  const chip = (r) => el("span", {class: "chip " + (r.status === "kept" ? "kept" : "dropped"),
                                  title: r.status, text: num(r.reward, 2)});
  function renderGroupList(list) {
    const rows = groupRows();
    document.getElementById("count").textContent = rows.length + " groups";
    if (!rows.length) { list.appendChild(el("div", {class: "empty", text: D.steps.length ? "No group matches these filters." : "No RL rollouts recorded for these runs (the local engine records them as it trains)."})); return; }
    for (const {st, g, key} of rows.slice(0, S.shown)) {
      list.appendChild(el("div", {class: "row" + (S.open === key ? " sel" : ""), onclick: () => set({open: key, shown: S.shown})},
        rowThumb(g, null),
        el("div", {class: "body"},
          el("div", {class: "q", text: g.question.split("\n")[0] || g.task_id}),
          el("div", {class: "meta"}, el("span", {class: "v " + (g.status === "kept" ? "v-right" : "v-unscored"), text: g.status === "kept" ? "kept #" + (g.rank + 1) : "dropped: " + g.status}),
            el("span", {text: st.run + " step " + st.step}), el("span", {text: "std " + num(g.std, 2)}),
            g.rollouts[0].steps ? el("span", {text: "trajectories"}) : null),
          el("div", {}, g.rollouts.map(chip)))));
    }
    if (rows.length > S.shown)
      list.appendChild(el("button", {class: "more", onclick: () => set({shown: S.shown + PAGE}), text: "show more"}));
  }
  function renderGroupDetail(box) {
    const row = groupRows().find(r => r.key === S.open) || (() => {
      for (const st of D.steps) for (const g of st.groups) if (st.run + "|" + st.step + "|" + g.group === S.open) return {st, g};
      return null; })();
    if (!row) { box.appendChild(el("div", {class: "empty", text: "Pick a group on the left: kept groups first (by rank), then the dropped ones."})); return; }
    const {st, g} = row;
    box.appendChild(samplePanel({benchmark: st.run + " step " + st.step + " · group " + g.group, id: g.task_id, question: g.question,
                                 gold: g.gold, options: g.options, inputs: g.inputs, video: g.video}, []));
    box.appendChild(el("p", {}, el("b", {text: g.status === "kept" ? "kept, rank " + (g.rank + 1) : "dropped: " + g.status}),
      "  ·  group reward mean " + num(g.mean) + ", std " + num(g.std) + " (each advantage is set against the whole group, before any filtering)"));
    const t = el("table", {class: "groups"}, el("tr", {}, ["rollout", "fate", "reward", "accuracy", "tool", "format", "advantage", "answer", "stop", "turns", "tool calls", "visual tokens"].map(h => el("th", {text: h}))));
    for (const r of g.rollouts)
      t.appendChild(el("tr", {}, [r.sample, r.status, num(r.reward), num(r.accuracy, 2), num(r.tool, 2), num(r.format, 2), num(r.advantage),
        r.prediction === null ? "(none)" : r.prediction, r.stop, r.turns, r.tools, r.visual].map(v => el("td", {text: String(v)}))));
    box.appendChild(t);
    if (g.rollouts.some(r => r.steps))
      box.appendChild(el("div", {class: "cols"}, g.rollouts.map(r => el("div", {class: "col"},
        el("h3", {}, "rollout " + r.sample, el("span", {class: "chip " + (r.status === "kept" ? "kept" : "dropped"), text: "reward " + num(r.reward, 2)}),
           el("span", {text: "advantage " + num(r.advantage, 2)})),
        r.steps ? turnsView(r.steps, "") : el("span", {class: "note", text: "trajectory not recorded"}),
        el("div", {class: "answer", text: "final answer: " + (r.prediction === null ? "(none)" : r.prediction) + "  ·  gold: " + g.gold})))));
    else box.appendChild(el("p", {class: "note", text: "Only rewards and advantages were recorded for this group (report.rollout_groups picks the groups whose trajectories are kept)."}));
  }

  // -- page ----------------------------------------------------------------------------------
  function render() {
    const app = document.getElementById("app");
    app.textContent = "";
    app.appendChild(header());
    app.appendChild(S.tab === "rollouts" ? rolloutFilters("") : evalFilters(""));
    const detail = el("div", {id: "detail"});
    app.appendChild(el("main", {}, el("div", {id: "list"}), detail));
    renderList();
    if (S.tab === "rollouts") renderGroupDetail(detail);
    else if (S.open) renderEvalDetail(detail);
    else summary(detail);
    const sel = document.querySelector(".row.sel");
    if (sel) sel.scrollIntoView({block: "nearest"});
  }
  readHash();
  window.addEventListener("hashchange", () => { readHash(); render(); });
  render();
  // Navigation start to the first view drawn (read by `pyvision perf report`).
  document.getElementById("app").dataset.readyMs = String(Math.round(performance.now()));
})();
