// The dashboard's account view, beside the jobs: the user's usage (last 24 hours and 30 days),
// Tinker training runs, sessions and checkpoints, and their newest audit entries, each table a
// page at a time from /v1/dashboard/* (the same session cookie as app.js). Everything is put
// on the page as text (textContent), never as HTML.
//
// app.js calls window.opentinkerAccount.show() once logged in and .hide() at the login form.
(function () {
  "use strict";

  const PAGE = 20;
  const REFRESH_MS = 15000;
  const KIND_LABELS = {
    training: "Training", sampling_prefill: "Sampling: prompt", sampling_sample: "Sampling: generated",
    compute_s: "Compute", checkpoint: "Checkpoints written", storage: "Checkpoint storage",
  };

  const $ = (id) => document.getElementById(id);

  async function get(path) {
    const response = await fetch(path, { headers: { "X-OpenTinker-Dashboard": "1" }, credentials: "same-origin",
                                         cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    return response.json();
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function when(seconds) {
    if (!seconds) return "";
    return new Date(seconds * 1000).toLocaleString(undefined, {
      month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", hourCycle: "h23",
    });
  }

  function bytes(size) {
    if (size === null || size === undefined) return "";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let value = size, unit = 0;
    while (value >= 1000 && unit < units.length - 1) { value /= 1000; unit += 1; }
    return (unit ? value.toPrecision(3) : String(value)) + " " + units[unit];
  }

  function quantity(kind, value, unit) {
    if (kind === "storage") return (value === 0 ? "0" : value.toPrecision(3)) + " " + unit;
    if (kind === "compute_s") return value.toFixed(1) + " s";
    return Math.round(value).toLocaleString() + " " + unit;
  }

  function status(text) {
    const node = el("span", text, "status");
    node.dataset.status = text === "ready" || text === "active" ? "running" : text;
    const cell = el("td");
    cell.appendChild(node);
    return cell;
  }

  function cell(text, className, title) {
    const td = el("td", text, className);
    if (title) td.title = title;
    return td;
  }

  // A table filled a page at a time: `path` answers {<key>: [...], total}, `cells(item)` the row.
  function pagedTable(id, path, key, cells) {
    const table = { offset: 0, total: 0 };
    table.load = async function () {
      let page;
      try {
        page = await get(path + "?limit=" + PAGE + "&offset=" + table.offset);
      } catch (err) {
        return;
      }
      const body = $(id).tBodies[0];
      body.replaceChildren();
      for (const item of page[key]) {
        const tr = document.createElement("tr");
        for (const td of cells(item)) tr.appendChild(td);
        body.appendChild(tr);
      }
      table.total = page.total;
      $(id + "-empty").hidden = page.total > 0;
      const pager = $(id + "-pager");
      pager.hidden = page.total <= PAGE;
      $(id + "-range").textContent = page.total ? (table.offset + 1) + "–" + (table.offset + page[key].length) +
        " of " + page.total : "";
      $(id + "-newer").disabled = table.offset === 0;
      $(id + "-older").disabled = table.offset + PAGE >= page.total;
    };
    $(id + "-newer").addEventListener("click", () => { table.offset = Math.max(0, table.offset - PAGE); table.load(); });
    $(id + "-older").addEventListener("click", () => { table.offset += PAGE; table.load(); });
    return table;
  }

  const tables = [
    pagedTable("tinker-runs", "/v1/dashboard/training-runs", "runs", (run) => [
      cell(run.model_id, "mono", run.model_id), cell(run.base_model), cell(run.lora_rank === null ? "full" : run.lora_rank, "num"),
      status(run.state), cell(when(run.last_request_at), "when"),
    ]),
    pagedTable("tinker-sessions", "/v1/dashboard/sessions", "sessions", (session) => [
      cell(session.session_id, "mono", session.session_id), cell(session.project_id || ""),
      cell(session.display_name || ""), status(session.state), cell(when(session.created_at), "when"),
    ]),
    pagedTable("tinker-checkpoints", "/v1/dashboard/checkpoints", "checkpoints", (checkpoint) => [
      cell(checkpoint.path, "mono", checkpoint.path), cell(checkpoint.kind), cell(bytes(checkpoint.size_bytes), "num"),
      cell(checkpoint.public === null ? "" : checkpoint.public ? "yes" : "no"),
      cell(checkpoint.expires_at ? "until " + when(checkpoint.expires_at) : "kept", "when"),
    ]),
  ];

  async function loadUsage() {
    let usage;
    try {
      usage = await get("/v1/dashboard/usage");
    } catch (err) {
      return;
    }
    const body = $("usage-totals").tBodies[0];
    body.replaceChildren();
    for (const kind of Object.keys(KIND_LABELS)) {
      const tr = document.createElement("tr");
      tr.dataset.kind = kind;
      tr.appendChild(cell(KIND_LABELS[kind]));
      for (const span of ["last_24h", "last_30d"]) {
        const value = usage[span].totals[kind] || 0;
        const td = cell(quantity(kind, value, usage.units[kind]), "num");
        td.dataset.window = span;
        td.dataset.value = String(value);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }

  async function loadAudit() {
    let page;
    try {
      page = await get("/v1/dashboard/audit?limit=" + PAGE);
    } catch (err) {
      return;
    }
    const list = $("audit-entries");
    list.replaceChildren();
    for (const entry of page.entries) {
      const details = Object.entries(entry.details || {}).map(([k, v]) => k + "=" + (typeof v === "string" ? v : JSON.stringify(v)));
      const item = el("li", new Date(entry.time).toLocaleString() + "  " + entry.event +
        (entry.key ? "  (key " + entry.key + ")" : "") + (details.length ? "  " + details.join(" ") : ""));
      item.dataset.event = entry.event;
      list.appendChild(item);
    }
    $("audit-empty").hidden = page.entries.length > 0;
  }

  let timer = null;

  function refresh() {
    loadUsage();
    for (const table of tables) table.load();
    loadAudit();
  }

  window.opentinkerAccount = {
    show() {
      $("account").hidden = false;
      for (const table of tables) table.offset = 0;
      refresh();
      clearInterval(timer);
      timer = setInterval(refresh, REFRESH_MS);
    },
    hide() {
      clearInterval(timer);
      timer = null;
      $("account").hidden = true;
    },
  };
})();
