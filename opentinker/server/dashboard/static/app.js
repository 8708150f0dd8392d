// The OpenTinker dashboard: plain JS over the server's own API, charts by uPlot.
//
// Logged in, the browser holds an HttpOnly session cookie; every request below is same-origin
// and sends it. Requests that change something also send X-OpenTinker-Dashboard: 1 (the
// server refuses cookie-authenticated POSTs without it). Everything a job carries (names,
// config, log lines, metric names) is put on the page as text (textContent), never as HTML.
//
// State for tests and curious users: window.opentinkerDashboard (charts[id].data holds the
// arrays the chart was last drawn with: [steps, series1, series2, ...]).
(function () {
  "use strict";

  const HEADERS = { "X-OpenTinker-Dashboard": "1" };
  const FINISHED = new Set(["completed", "failed", "cancelled", "interrupted"]);
  const STOPPED = new Set(["failed", "cancelled", "interrupted"]); // what POST .../resume accepts
  const EVENT_TYPES = ["status", "progress", "metrics", "checkpoint", "error", "log"];
  const JOBS_REFRESH_MS = 3000;
  const HISTORY_PAGE = 5000;
  const LOG_LINES = 200;
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563",
                  "#65a30d", "#9333ea"];

  // A chart per group of metrics; `match` returns the series label of a metric name, or null.
  const GROUPS = [
    { id: "reward", title: "Reward", y: "reward",
      match: (n) => (/^reward(\/(mean|max|min|std))?$/.test(n) ? n : null) },
    { id: "kl", title: "KL divergence", y: "KL",
      match: (n) => (/(^|\/)([a-z0-9]+_)*kl$/.test(n) ? n : null) },
    { id: "response_length", title: "Response length", y: "tokens",
      match: (n) => (/^response_length\/(mean|max|min)$/.test(n) ? n : null) },
    { id: "env_reward", title: "Reward per environment", y: "reward",
      match: (n) => { const m = /^env\/(.+)\/reward_mean$/.exec(n); return m ? m[1] : null; } },
    { id: "env_turns", title: "Turns per environment", y: "turns",
      match: (n) => { const m = /^env\/(.+)\/turns_mean$/.exec(n); return m ? m[1] : null; } },
    { id: "validation", title: "Validation", y: "score",
      match: (n) => (/^val\/(accuracy|reward_mean|pass@\d+)$/.test(n) ? n : null) },
    { id: "timing", title: "Step timings", y: "seconds",
      match: (n) => { const m = /^timing_s\/(.+)$/.exec(n); return m ? (m[1] === "step" ? "whole step" : m[1]) : null; } },
  ];

  const $ = (id) => document.getElementById(id);

  const dash = {
    user: null,
    jobs: [],
    jobId: null,
    job: null, // the selected job's JobInfo
    status: null, // its status as the events tell it
    lastEventId: 0,
    checkpoints: [],
    latestMetrics: null,
    charts: {}, // id -> {title, labels, rows: Map(step -> {label: value}), data, plot, element}
    source: null, // the EventSource of the selected job, while it runs
    generation: 0, // bumped on every job switch: answers for an earlier selection are dropped
    ready: false,
    chartData(id) {
      const chart = this.charts[id];
      return chart ? { labels: chart.labels.slice(), data: chart.plot ? chart.plot.data : chart.data } : null;
    },
  };
  window.opentinkerDashboard = dash;

  // --- HTTP -----------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(method, path, body) {
    const init = { method, headers: { ...HEADERS }, credentials: "same-origin", cache: "no-store" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      throw new ApiError(0, "the server cannot be reached (" + err.message + ")");
    }
    let data = null;
    if (response.status !== 204) {
      try { data = await response.json(); } catch (err) { data = null; }
    }
    if (!response.ok) {
      const message = data && typeof data.error === "string" ? data.error : "HTTP " + response.status;
      if (response.status === 401 && path !== "/v1/session") showLogin(message);
      throw new ApiError(response.status, message);
    }
    return data;
  }

  const jobPath = (jobId) => "/v1/jobs/" + encodeURIComponent(jobId);

  // --- small DOM helpers (text only) ----------------------------------------------------

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) tr.appendChild(cell instanceof Node ? cell : el("td", cell));
    return tr;
  }

  function when(seconds) {
    if (!seconds) return "";
    return new Date(seconds * 1000).toLocaleString(undefined, {
      month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", hourCycle: "h23",
    });
  }

  function formatNumber(value) {
    if (typeof value !== "number") return String(value);
    if (Number.isInteger(value)) return String(value);
    const abs = Math.abs(value);
    return abs !== 0 && (abs < 1e-3 || abs >= 1e5) ? value.toExponential(3) : value.toPrecision(4);
  }

  function showMessage(node, message) {
    node.textContent = message || "";
    node.hidden = !message;
  }

  // --- login ----------------------------------------------------------------------------

  function showLogin(message) {
    closeStream();
    dash.user = null;
    dash.generation += 1;
    $("dashboard").hidden = true;
    if (window.opentinkerAccount) window.opentinkerAccount.hide();
    $("who").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message && dash.ready ? message : "";
    $("api-key").focus();
  }

  function showDashboard(session) {
    dash.user = session.user;
    $("who").textContent = session.user;
    $("who").hidden = false;
    $("logout").hidden = false;
    $("login").hidden = true;
    $("dashboard").hidden = false;
    if (window.opentinkerAccount) window.opentinkerAccount.show(); // usage, Tinker runs, audit (account.js)
    refreshJobs();
    const selected = new URLSearchParams(location.hash.slice(1)).get("job");
    if (selected) selectJob(selected);
  }

  async function logIn(event) {
    event.preventDefault();
    const input = $("api-key");
    $("login-error").textContent = "";
    try {
      await api("POST", "/v1/session", { api_key: input.value.trim() });
    } catch (err) {
      $("login-error").textContent = err.message;
      return;
    }
    input.value = "";
    const session = await api("GET", "/v1/session");
    showDashboard(session);
  }

  async function logOut() {
    try { await api("DELETE", "/v1/session"); } catch (err) { /* the cookie is gone either way */ }
    dash.jobId = null;
    history.replaceState(null, "", location.pathname);
    $("job").hidden = true;
    showLogin("");
  }

  // --- the job list ---------------------------------------------------------------------

  async function refreshJobs() {
    if (!dash.user) return;
    let list;
    try {
      list = await api("GET", "/v1/jobs");
    } catch (err) {
      return;
    }
    dash.jobs = list.jobs;
    renderJobs();
    const selected = dash.jobs.find((j) => j.job_id === dash.jobId);
    if (selected && dash.job) {
      // Status and step also come by events; the list catches what a dropped stream missed.
      dash.job = { ...dash.job, step: Math.max(dash.job.step, selected.step), error: selected.error,
                   relay: selected.relay };
      if (selected.status !== dash.status && !dash.source) setStatus(selected.status);
      renderJobHead();
      if (!FINISHED.has(selected.status) && !dash.source) openStream(dash.jobId, dash.generation);
    }
  }

  function renderJobs() {
    const body = $("jobs").tBodies[0];
    body.replaceChildren();
    for (const job of dash.jobs) {
      const name = el("td", job.name || "(unnamed) " + job.job_id.slice(0, 8));
      name.title = job.job_id;
      const status = el("span", job.status, "status");
      status.dataset.status = job.status;
      const statusCell = el("td");
      statusCell.appendChild(status);
      const tr = row([name, statusCell, el("td", job.step + "/" + job.total_steps, "num"), el("td", when(job.created_at))]);
      tr.dataset.jobId = job.job_id;
      if (job.job_id === dash.jobId) tr.classList.add("selected");
      tr.addEventListener("click", () => selectJob(job.job_id));
      body.appendChild(tr);
    }
    $("jobs-empty").hidden = dash.jobs.length > 0;
  }

  // --- one job --------------------------------------------------------------------------

  async function selectJob(jobId) {
    closeStream();
    const generation = ++dash.generation;
    dash.jobId = jobId;
    dash.job = null;
    dash.status = null;
    dash.lastEventId = 0;
    dash.checkpoints = [];
    dash.latestMetrics = null;
    resetCharts();
    $("log").replaceChildren();
    showMessage($("action-error"), "");
    history.replaceState(null, "", "#job=" + encodeURIComponent(jobId));
    renderJobs();

    let job;
    try {
      job = await api("GET", jobPath(jobId));
    } catch (err) {
      if (generation === dash.generation) {
        $("job").hidden = true;
        showMessage($("action-error"), err.message);
      }
      return;
    }
    if (generation !== dash.generation) return;
    dash.job = job;
    dash.status = job.status;
    $("job").hidden = false;
    $("job").dataset.jobId = job.job_id;
    renderJobHead();
    renderConfig(job.config);
    refreshCheckpoints(generation);
    await loadHistory(jobId, generation);
    if (generation !== dash.generation) return;
    if (!FINISHED.has(dash.status)) openStream(jobId, generation);
    else if (dash.status !== job.status) refreshJob(generation); // it ended while we read its events
  }

  async function loadHistory(jobId, generation) {
    // What is stored, in pages, then the stream takes over from the last id.
    for (;;) {
      let page;
      try {
        page = await api("GET", jobPath(jobId) + "/events?stream=false&limit=" + HISTORY_PAGE + "&after=" + dash.lastEventId);
      } catch (err) {
        return;
      }
      if (generation !== dash.generation) return;
      for (const event of page.events) handleEvent(event, false);
      if (page.events.length < HISTORY_PAGE) break;
    }
    renderCharts();
    renderLatestMetrics();
  }

  function openStream(jobId, generation) {
    closeStream();
    const source = new EventSource(jobPath(jobId) + "/events?after=" + dash.lastEventId);
    dash.source = source;
    $("job-live").textContent = "live";
    for (const type of EVENT_TYPES) {
      source.addEventListener(type, (message) => {
        if (generation !== dash.generation) return;
        handleEvent(JSON.parse(message.data), true);
      });
    }
    source.onerror = () => {
      if (source.readyState !== EventSource.CLOSED) return; // it reconnects with Last-Event-ID
      if (dash.source === source) closeStream();
      // Refused: a 401 (the session ended) shows the login; otherwise the job list refresh
      // reopens the stream while the job runs.
      api("GET", "/v1/session").catch((err) => { if (err.status === 401) showLogin(err.message); });
    };
  }

  function closeStream() {
    if (dash.source) dash.source.close();
    dash.source = null;
    $("job-live").textContent = "";
  }

  let renderTimer = null;
  function scheduleRender() {
    if (renderTimer !== null) return;
    renderTimer = setTimeout(() => {
      renderTimer = null;
      renderCharts();
      renderLatestMetrics();
    }, 150);
  }

  function handleEvent(event, live) {
    if (event.id <= dash.lastEventId) return;
    dash.lastEventId = event.id;
    const data = event.data || {};
    switch (event.type) {
      case "status":
        setStatus(data.status);
        if (data.reason) addLog(event, "status " + data.status + ": " + data.reason, false);
        if (live && FINISHED.has(data.status)) {
          closeStream(); // the server ends the stream after this event: do not reconnect
          renderCharts();
          renderLatestMetrics();
          refreshJob(dash.generation);
          refreshCheckpoints(dash.generation);
        }
        break;
      case "progress":
        if (dash.job && typeof data.step === "number") {
          dash.job.step = Math.max(dash.job.step, data.step);
          if (typeof data.total_steps === "number") dash.job.total_steps = data.total_steps;
          renderJobHead();
        }
        break;
      case "metrics":
        addMetrics(data.step, data.metrics || {});
        if (live) scheduleRender();
        break;
      case "checkpoint":
        addLog(event, "checkpoint " + data.name + " saved", false);
        if (live) refreshCheckpoints(dash.generation);
        break;
      case "error":  // the id is what to quote to the operator, who has the trace
        addLog(event, data.message + (data.error_id ? " (error id " + data.error_id + ")" : ""), true);
        break;
      case "log":
        addLog(event, data.message, data.level === "warning" || data.level === "error");
        break;
    }
  }

  function setStatus(status) {
    dash.status = status;
    if (dash.job) dash.job.status = status;
    renderJobHead();
  }

  async function refreshJob(generation) {
    try {
      const job = await api("GET", jobPath(dash.jobId));
      if (generation !== dash.generation) return;
      dash.job = job;
      dash.status = job.status;
      renderJobHead();
    } catch (err) { /* shown by the next refresh */ }
    refreshJobs();
  }

  function renderJobHead() {
    const job = dash.job;
    if (!job) return;
    const status = dash.status || job.status;
    $("job-title").textContent = job.name || "(unnamed job)";
    $("job-id").textContent = job.job_id;
    $("job-mode").textContent = job.mode;
    const statusNode = $("job-status");
    statusNode.textContent = status;
    statusNode.dataset.status = status;
    $("job-step").textContent = job.step + " / " + job.total_steps;
    $("job-step").dataset.step = String(job.step);
    $("job-progress").max = Math.max(job.total_steps, 1);
    $("job-progress").value = job.step;
    showMessage($("job-error"), status === "completed" ? "" : job.error);
    // A job whose env is on its user's machine: is the client that carries its env calls there?
    const relay = job.relay;
    $("job-relay").hidden = !relay || FINISHED.has(status);
    if (relay) {
      const state = $("job-relay-state");
      state.textContent = relay.connected ? "connected" : "not connected";
      state.dataset.status = relay.connected ? "running" : "queued";
      state.title = relay.connected
        ? "the job's client carries the env calls of " + relay.interactions.join(", ")
        : "the env calls of " + relay.interactions.join(", ") + " wait for the job's client " +
          "(job.attach() or `opentinker jobs logs -f` on the machine with the env)";
    }

    const cancel = $("cancel");
    cancel.hidden = FINISHED.has(status);
    if (cancel.hidden) { cancel.disabled = false; cancel.textContent = "Cancel"; }
    const resume = $("resume");
    resume.hidden = !STOPPED.has(status);
    const usable = dash.checkpoints.some((c) => c.step > 0 && c.step <= job.step);
    resume.disabled = !usable;
    resume.title = usable ? "continue from the last checkpoint" : "no checkpoint to resume from";
  }

  async function cancelJob() {
    const button = $("cancel");
    button.disabled = true;
    button.textContent = "Cancelling…";
    showMessage($("action-error"), "");
    const generation = dash.generation;
    try {
      const job = await api("POST", jobPath(dash.jobId) + "/cancel");
      if (generation !== dash.generation) return;
      // The answer already says "cancelled", but the runner is still finishing its step: the
      // page shows it (and offers Resume) once the final status event arrives, i.e. once the
      // runner is done. Without a stream, the job list's refresh brings the status.
      if (!dash.source && FINISHED.has(job.status)) setStatus(job.status);
    } catch (err) {
      showMessage($("action-error"), "Cancel refused: " + err.message);
      button.disabled = false;
      button.textContent = "Cancel";
    }
    refreshJobs();
  }

  async function resumeJob() {
    showMessage($("action-error"), "");
    const generation = dash.generation;
    try {
      const job = await api("POST", jobPath(dash.jobId) + "/resume");
      if (generation !== dash.generation) return;
      dash.job = { ...dash.job, ...job, config: dash.job.config };
      setStatus(job.status);
      openStream(dash.jobId, generation);
    } catch (err) {
      showMessage($("action-error"), "Resume refused: " + err.message);
    }
    refreshJobs();
  }

  async function refreshCheckpoints(generation) {
    let list;
    try {
      list = await api("GET", jobPath(dash.jobId) + "/checkpoints");
    } catch (err) {
      return;
    }
    if (generation !== dash.generation) return;
    dash.checkpoints = list.checkpoints;
    const body = $("checkpoints").tBodies[0];
    body.replaceChildren();
    for (const checkpoint of dash.checkpoints) {
      const link = el("a", "Download .tar.gz");
      link.href = jobPath(dash.jobId) + "/checkpoints/" + encodeURIComponent(checkpoint.name) + "/download";
      link.setAttribute("download", "");
      const linkCell = el("td");
      linkCell.appendChild(link);
      const tr = row([checkpoint.name, el("td", checkpoint.step, "num"), when(checkpoint.created_at), linkCell]);
      tr.dataset.checkpoint = checkpoint.name;
      body.appendChild(tr);
    }
    $("checkpoints-empty").hidden = dash.checkpoints.length > 0;
    renderJobHead();
  }

  function renderConfig(config) {
    const body = $("config").tBodies[0];
    body.replaceChildren();
    for (const key of Object.keys(config || {}).sort()) {
      const value = config[key];
      const tr = row([key, typeof value === "string" ? value : JSON.stringify(value)]);
      tr.dataset.key = key;
      body.appendChild(tr);
    }
  }

  function addLog(event, message, isError) {
    const list = $("log");
    const time = new Date(event.created_at * 1000).toLocaleTimeString();
    list.appendChild(el("li", time + "  " + message, isError ? "error" : ""));
    while (list.children.length > LOG_LINES) list.firstChild.remove();
    list.scrollTop = list.scrollHeight;
  }

  // --- charts ---------------------------------------------------------------------------

  function resetCharts() {
    for (const chart of Object.values(dash.charts)) if (chart.plot) chart.plot.destroy();
    dash.charts = {};
    $("charts").replaceChildren();
    $("latest-metrics").tBodies[0].replaceChildren();
    $("latest-step").textContent = "";
  }

  function addMetrics(step, metrics) {
    if (typeof step !== "number") return;
    const numeric = {};
    for (const [name, value] of Object.entries(metrics)) {
      // A NaN or infinity arrives as null: it is a gap, not a point.
      if (value === null || (typeof value === "number" && Number.isFinite(value))) numeric[name] = value;
    }
    dash.latestMetrics = { step, metrics: numeric };
    for (const group of GROUPS) {
      const values = {};
      let any = false;
      for (const [name, value] of Object.entries(numeric)) {
        const label = group.match(name);
        if (label === null) continue;
        values[label] = value;
        any = true;
      }
      if (!any) continue;
      let chart = dash.charts[group.id];
      if (!chart) {
        chart = { id: group.id, title: group.title, labels: [], rows: new Map(), data: [[]], plot: null, element: null, shape: "" };
        dash.charts[group.id] = chart;
      }
      for (const label of Object.keys(values).sort()) if (!chart.labels.includes(label)) chart.labels.push(label);
      chart.rows.set(step, { ...(chart.rows.get(step) || {}), ...values }); // a step seen again replaces its values
    }
  }

  function renderCharts() {
    const container = $("charts");
    let count = 0;
    for (const group of GROUPS) {
      const chart = dash.charts[group.id];
      if (!chart) continue;
      count += 1;
      const steps = Array.from(chart.rows.keys()).sort((a, b) => a - b);
      const data = [steps];
      for (const label of chart.labels) {
        data.push(steps.map((s) => {
          const value = chart.rows.get(s)[label];
          return value === undefined ? null : value;
        }));
      }
      chart.data = data;
      const shape = chart.labels.join("\u0000");
      if (!chart.element) {
        chart.element = el("div", null, "card chart");
        chart.element.dataset.chart = group.id;
        // Keep the groups' order whatever order their first metrics came in.
        const next = GROUPS.slice(GROUPS.indexOf(group) + 1).map((g) => dash.charts[g.id] && dash.charts[g.id].element)
          .find((node) => node && node.parentNode === container);
        container.insertBefore(chart.element, next || null);
      }
      if (chart.plot && chart.shape === shape) {
        chart.plot.setData(data);
      } else {
        if (chart.plot) chart.plot.destroy(); // a new series: uPlot is rebuilt with it
        chart.plot = new uPlot(chartOptions(group, chart), data, chart.element);
        chart.shape = shape;
      }
      chart.plot.setLegend({ idx: steps.length - 1 }); // the legend shows the latest values until hovered
    }
    $("charts-empty").hidden = count > 0 || !dash.job;
  }

  function chartWidth() {
    const container = $("charts");
    const columns = getComputedStyle(container).gridTemplateColumns.split(" ").length || 1;
    const gap = 16;
    return Math.max(300, Math.floor((container.clientWidth - gap * (columns - 1)) / columns) - 30);
  }

  function chartOptions(group, chart) {
    return {
      title: group.title,
      width: chartWidth(),
      height: 230,
      scales: {
        x: { time: false, range: (u, min, max) => (min === max ? [min - 1, max + 1] : [min, max]) },
        // A flat series (a KL of 0) gets a small range around its value, not uPlot's 0..100.
        y: { range: (u, min, max) => (min === max ? [min - (Math.abs(min) / 10 || 1), max + (Math.abs(max) / 10 || 1)]
                                                  : uPlot.rangeNum(min, max, 0.1, true)) },
      },
      series: [
        { label: "step", value: (u, v) => (v === null || v === undefined ? "--" : String(v)) },
        ...chart.labels.map((label, i) => ({
          label,
          stroke: COLORS[i % COLORS.length],
          width: 2,
          spanGaps: true,
          points: { show: true, size: 5 },
          value: (u, v) => (v === null || v === undefined ? "--" : formatNumber(v)),
        })),
      ],
      axes: [
        { label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] },
        { label: group.y, size: 60 },
      ],
      legend: { show: true, live: true },
    };
  }

  function resizeCharts() {
    const width = chartWidth();
    for (const chart of Object.values(dash.charts)) {
      if (chart.plot) chart.plot.setSize({ width, height: 230 });
    }
  }

  function renderLatestMetrics() {
    const body = $("latest-metrics").tBodies[0];
    body.replaceChildren();
    const latest = dash.latestMetrics;
    $("latest-step").textContent = latest ? "(step " + latest.step + ")" : "";
    if (!latest) return;
    for (const name of Object.keys(latest.metrics).sort()) {
      if (name === "step") continue; // said in the heading
      const value = latest.metrics[name];
      const tr = row([name, el("td", value === null ? "NaN" : formatNumber(value), "num")]);
      tr.dataset.metric = name;
      body.appendChild(tr);
    }
  }

  // --- start ----------------------------------------------------------------------------

  async function start() {
    $("login-form").addEventListener("submit", logIn);
    $("logout").addEventListener("click", logOut);
    $("cancel").addEventListener("click", cancelJob);
    $("resume").addEventListener("click", resumeJob);
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(resizeCharts, 100);
    });
    setInterval(refreshJobs, JOBS_REFRESH_MS);
    try {
      const session = await api("GET", "/v1/session");
      dash.ready = true;
      showDashboard(session);
    } catch (err) {
      dash.ready = true;
      showLogin("");
    }
  }

  start();
})();
