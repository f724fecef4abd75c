// newsnack dashboard: plain JavaScript, no dependencies.
//
// 1. GET /dashboard.json: counts, claims, recent transitions, runs, the
//    latest briefing and the LLM budget, all as of one log position
//    `last_seq`.
// 2. EventSource on /events?since=<last_seq>: every later transition, in
//    order, with no gap (the browser resumes with Last-Event-ID after a
//    disconnect or a `dropped` notice). A `reset` notice (the log no longer
//    reaches what the page shows) starts the page over from a snapshot.
// Counts move with each event's from/to. Claims, runs and the briefing are
// re-fetched from /dashboard.json (debounced) when events arrive.
(function () {
  "use strict";

  const STATUSES = ["PENDING", "IN_PROGRESS", "DONE", "FAILED"];
  const MAX_ROWS = 200;
  const REFRESH_DEBOUNCE_MS = 300;
  const REFRESH_MAX_WAIT_MS = 2000;
  const POLL_WHILE_DOWN_MS = 10000;
  // A pipeline run can end, and a briefing appear, without any transition
  // (a run that ends at its deadline): while live, those panels are read
  // again this often too.
  const REFRESH_WHILE_LIVE_MS = 30000;
  const RECONNECT_MS = 3000;

  const state = {
    counts: {},
    // Events up to this seq are already reflected in `counts`.
    countsAsOf: 0,
    // The newest seq shown in the stream.
    shownSeq: 0,
    titles: new Map(),
    // Server clock minus ours, in ms, for lease countdowns.
    skew: 0,
    source: null,
    live: "connecting",
    refresh: { timer: null, firstAsked: 0, running: false, again: false },
    // When the LLM pause shown ends (server clock, ms); 0 when none.
    pauseUntil: 0,
  };

  // Exposed for the browser test and for curious operators.
  const stats = { events: 0, snapshots: 0, dropped: 0, reconnects: 0, resets: 0 };
  window.newsnackDashboard = { state, stats };

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null) continue;
      if (key === "class") node.className = value;
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else node[key] = value;
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function badge(status) {
    if (!status) return el("span", { class: "badge none" }, "new");
    return el("span", { class: "badge s-" + status }, status);
  }

  function pad(n, width) {
    return String(n).padStart(width || 2, "0");
  }

  function clock(iso) {
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return "–";
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  function when(iso) {
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return "–";
    const today = new Date();
    const sameDay = d.toDateString() === today.toDateString();
    const date = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate());
    return (sameDay ? "" : date + " ") + clock(iso);
  }

  function duration(ms) {
    const s = Math.round(Math.abs(ms) / 1000);
    if (s < 60) return s + "s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + "m " + pad(s % 60) + "s";
    return Math.floor(m / 60) + "h " + pad(m % 60) + "m";
  }

  function serverNow() {
    return Date.now() + state.skew;
  }

  // ---- counts -----------------------------------------------------------

  function renderCounts(changed) {
    let total = 0;
    for (const status of STATUSES) {
      const n = state.counts[status] || 0;
      total += n;
      const node = $("count-" + status);
      if (node.dataset.count !== String(n)) {
        node.textContent = n.toLocaleString("en-US");
        node.dataset.count = String(n);
        if (changed && changed.has(status)) {
          node.classList.remove("bump");
          void node.offsetWidth; // restart the animation
          node.classList.add("bump");
        }
      }
    }
    const totalNode = $("count-total");
    totalNode.textContent = total.toLocaleString("en-US");
    totalNode.dataset.count = String(total);
  }

  // ---- the transition stream --------------------------------------------

  function transitionRow(t, via) {
    const title = t.title || state.titles.get(t.issue_id) || "";
    const row = el(
      "li",
      {
        class: "s-" + t.to + (via === "stream" ? " fresh" : ""),
        "data-seq": t.seq,
        "data-issue": t.issue_id,
        "data-from": t.from || "",
        "data-to": t.to,
        "data-via": via,
        title: t.reason || "",
      },
      el("span", { class: "time" }, clock(t.at)),
      el("span", { class: "seqno", title: "log position" }, "seq " + t.seq),
      el(
        "span",
        { class: "issue" },
        el("span", { class: "id" }, "#" + t.issue_id),
        el("span", { class: "title", "data-title-of": t.issue_id }, title)
      ),
      el(
        "span",
        { class: "move" },
        badge(t.from),
        el("span", { class: "arrow" }, "→"),
        badge(t.to),
        t.fatal ? el("span", { class: "flag", title: "no automatic retry" }, "fatal") : null
      )
    );
    return row;
  }

  function showTransition(t, via) {
    if (t.seq <= state.shownSeq) return false;
    state.shownSeq = t.seq;
    const list = $("transitions");
    list.prepend(transitionRow(t, via));
    while (list.children.length > MAX_ROWS) list.lastElementChild.remove();
    $("stream-empty").hidden = true;
    $("last-seq").textContent = String(t.seq);
    return true;
  }

  function onTransition(t) {
    stats.events += 1;
    if (!showTransition(t, "stream")) return;
    if (t.seq > state.countsAsOf) {
      const changed = new Set([t.to]);
      if (t.from) {
        state.counts[t.from] = Math.max(0, (state.counts[t.from] || 0) - 1);
        changed.add(t.from);
      }
      state.counts[t.to] = (state.counts[t.to] || 0) + 1;
      state.countsAsOf = t.seq;
      renderCounts(changed);
    }
    scheduleRefresh();
  }

  function fillTitles() {
    for (const node of document.querySelectorAll("[data-title-of]")) {
      if (node.textContent) continue;
      const title = state.titles.get(Number(node.dataset.titleOf));
      if (title) node.textContent = title;
    }
  }

  // ---- claims -----------------------------------------------------------

  function renderClaims(inFlight) {
    const body = $("claims");
    body.replaceChildren(
      ...inFlight.map((c) =>
        el(
          "tr",
          { "data-issue": c.id },
          el(
            "td",
            { class: "ellipsis", title: c.title },
            el("span", { class: "id" }, "#" + c.id),
            el("span", { class: "title" }, c.title)
          ),
          el("td", { class: "holder", title: c.claimed_by || "" }, c.claimed_by || "—"),
          el("td", { class: "num" }, c.attempts),
          el("td", { class: "mono" }, c.lease_until ? clock(c.lease_until) : "—"),
          el(
            "td",
            { class: "num" },
            c.lease_until
              ? el(
                  "span",
                  {
                    class: "countdown",
                    "data-lease": c.lease_until,
                    "data-since": c.since,
                  },
                  ""
                )
              : "—"
          )
        )
      )
    );
    $("claims-empty").hidden = inFlight.length > 0;
    tickLeases();
  }

  function tickLeases() {
    const now = serverNow();
    for (const node of document.querySelectorAll("[data-lease]")) {
      const until = Date.parse(node.dataset.lease);
      const since = Date.parse(node.dataset.since);
      const left = until - now;
      node.classList.toggle("expired", left <= 0);
      node.classList.toggle("low", left > 0 && left < 15000);
      const text = left > 0 ? duration(left) : "expired " + duration(left) + " ago";
      const share = since < until ? Math.max(0, Math.min(1, left / (until - since))) : 0;
      const fill = el("span");
      fill.style.width = (share * 100).toFixed(1) + "%";
      node.replaceChildren(text, el("span", { class: "lease-bar" }, fill));
    }
  }

  // ---- runs -------------------------------------------------------------

  function renderRuns(runs) {
    $("runs").replaceChildren(
      ...runs.map((r) => {
        const outcome = el("span", { class: "badge outcome o-" + r.outcome }, r.outcome.replace("_", " "));
        const extra = r.error
          ? el("div", { class: "title ellipsis", title: r.error }, r.error)
          : r.briefing_id
            ? el("div", { class: "title" }, "briefing #" + r.briefing_id)
            : null;
        const took = r.finished_at ? duration(Date.parse(r.finished_at) - Date.parse(r.started_at)) : "";
        return el(
          "tr",
          { "data-run": r.id, "data-outcome": r.outcome },
          el("td", {}, el("span", { class: "id" }, "#" + r.id)),
          el("td", { class: "mono", title: took ? "took " + took : "" }, when(r.started_at)),
          el("td", { class: "holder", title: r.instance }, r.trigger),
          el("td", { class: "num" }, r.completed.length + "/" + r.targets.length),
          el("td", {}, outcome, extra)
        );
      })
    );
    $("runs-empty").hidden = runs.length > 0;
  }

  // ---- the LLM budget ---------------------------------------------------

  function number(n) {
    return Number(n).toLocaleString("en-US");
  }

  function renderLlm(llm) {
    if (!llm) return;
    const inFlight = $("llm-in-flight");
    inFlight.textContent = number(llm.in_flight);
    inFlight.dataset.count = String(llm.in_flight);
    $("llm-limit").textContent = number(llm.max_in_flight);
    $("llm-rate").textContent =
      llm.requests_per_minute > 0
        ? " · " + number(llm.started_last_minute) + " of " + number(llm.requests_per_minute) + " started this minute"
        : "";
    const share = llm.max_in_flight > 0 ? Math.min(1, llm.in_flight / llm.max_in_flight) : 0;
    $("llm-bar").style.width = (share * 100).toFixed(1) + "%";
    $("llm-waiting-briefing").textContent = number(llm.waiting_briefing);
    $("llm-waiting-feed").textContent = number(llm.waiting_feed);
    $("tokens-today-prompt").textContent = number(llm.tokens_today.prompt);
    $("tokens-today-completion").textContent = number(llm.tokens_today.completion);
    $("tokens-briefing-prompt").textContent = number(llm.tokens_latest_briefing.prompt);
    $("tokens-briefing-completion").textContent = number(llm.tokens_latest_briefing.completion);
    const day = llm.day;
    $("llm-day").textContent =
      day.budget > 0
        ? number(day.tokens) + " of " + number(day.budget) + " tokens spent today (" + day.timezone + "), " +
          number(day.briefing_reserve) + " kept for the briefing"
        : number(day.tokens) + " tokens spent today (" + day.timezone + "), no daily budget";
    $("llm-providers").textContent = (llm.providers || [])
      .map((p) => {
        let text = p.provider + ": " + p.state + ", " + number(p.in_flight) + " in flight";
        if (p.state !== "up" && p.last_error) text += " (" + p.last_error + ")";
        return text;
      })
      .join(" · ");
    const held = $("llm-held");
    held.hidden = !day.state;
    held.textContent = day.state ? "Daily token budget: " + day.state : "";
    const pause = llm.pause;
    const paused = Boolean(pause && pause.active);
    $("llm").dataset.paused = paused ? "1" : "0";
    const banner = $("llm-pause");
    banner.hidden = !paused;
    if (paused && !pause.until) {
      // The operator's pause: no end until someone resumes.
      state.pauseUntil = 0;
      banner.textContent = "Paused by the operator: no LLM call starts until `newsnack resume`";
      banner.title = pause.reason || "";
    } else if (paused) {
      state.pauseUntil = Date.parse(pause.until);
      banner.dataset.reason = pause.reason || "";
      banner.title = pause.reason || "";
      tickPause();
    } else {
      state.pauseUntil = 0;
    }
  }

  // The pause counts down between snapshots; its end brings a new one.
  function tickPause() {
    const banner = $("llm-pause");
    if (!state.pauseUntil) return;
    const left = state.pauseUntil - serverNow();
    if (left <= 0) {
      state.pauseUntil = 0;
      banner.hidden = true;
      $("llm").dataset.paused = "0";
      scheduleRefresh();
      return;
    }
    banner.textContent =
      "Paused by a rate limit for " + duration(left) + " more (until " + clock(new Date(state.pauseUntil).toISOString()) + ")" +
      (banner.dataset.reason ? ": " + banner.dataset.reason : "");
  }

  // ---- the briefing (a tiny Markdown subset) ----------------------------

  function inline(text) {
    const out = document.createDocumentFragment();
    const pattern = /(\*\*[^*]+\*\*|`[^`]+`|\[[^\]]+\]\(https?:\/\/[^)\s]+\)|\*[^*\s][^*]*\*|_[^_\s][^_]*_)/g;
    let last = 0;
    for (const match of text.matchAll(pattern)) {
      out.append(text.slice(last, match.index));
      const token = match[0];
      if (token.startsWith("**")) out.append(el("strong", {}, token.slice(2, -2)));
      else if (token.startsWith("`")) out.append(el("code", {}, token.slice(1, -1)));
      else if (token.startsWith("[")) {
        const close = token.indexOf("](");
        out.append(
          el("a", { href: token.slice(close + 2, -1), rel: "noopener noreferrer", target: "_blank" }, token.slice(1, close))
        );
      } else out.append(el("em", {}, token.slice(1, -1)));
      last = match.index + token.length;
    }
    out.append(text.slice(last));
    return out;
  }

  function markdown(source) {
    const root = document.createDocumentFragment();
    let paragraph = [];
    let list = null;
    const flush = () => {
      if (paragraph.length) root.append(el("p", {}, inline(paragraph.join(" "))));
      paragraph = [];
      list = null;
    };
    for (const raw of source.split(/\r?\n/)) {
      const line = raw.trim();
      const heading = /^(#{1,4})\s+(.*)$/.exec(line);
      const item = /^[-*+]\s+(.*)$/.exec(line);
      if (!line) {
        flush();
      } else if (heading) {
        flush();
        root.append(el("h" + heading[1].length, {}, inline(heading[2])));
      } else if (item) {
        if (paragraph.length) flush();
        if (!list) {
          list = el("ul");
          root.append(list);
        }
        list.append(el("li", {}, inline(item[1])));
      } else {
        list = null;
        paragraph.push(line);
      }
    }
    flush();
    return root;
  }

  function renderBriefing(b) {
    const article = $("briefing");
    if (!b) {
      article.replaceChildren();
      article.removeAttribute("data-briefing");
      $("briefing-meta").textContent = "";
      $("briefing-empty").hidden = false;
      return;
    }
    if (article.dataset.briefing === String(b.id)) return;
    article.dataset.briefing = String(b.id);
    article.replaceChildren(markdown(b.body));
    $("briefing-meta").textContent =
      "#" + b.id + " · " + b.briefing_date + " · issues " + b.issue_ids.join(", ");
    $("briefing-empty").hidden = true;
  }

  // ---- snapshots --------------------------------------------------------

  async function fetchSnapshot() {
    const response = await fetch("/dashboard.json", { cache: "no-store", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error("/dashboard.json answered " + response.status);
    const snap = await response.json();
    stats.snapshots += 1;
    state.skew = Date.parse(snap.now) - Date.now();
    for (const t of snap.transitions) if (t.title) state.titles.set(t.issue_id, t.title);
    for (const c of snap.in_flight) state.titles.set(c.id, c.title);
    return snap;
  }

  function applySnapshot(snap) {
    // Counts are replaced only by a snapshot at least as new as what the
    // stream has shown; events up to its last_seq are then already in them.
    if (snap.last_seq >= state.countsAsOf) {
      state.counts = Object.assign({}, snap.counts);
      state.countsAsOf = snap.last_seq;
      renderCounts(null);
    }
    // Transitions the stream has not delivered (yet), oldest first.
    const missing = snap.transitions.filter((t) => t.seq > state.shownSeq).sort((a, b) => a.seq - b.seq);
    for (const t of missing) showTransition(t, "snapshot");
    state.shownSeq = Math.max(state.shownSeq, snap.last_seq);
    $("last-seq").textContent = String(state.shownSeq);
    fillTitles();
    renderClaims(snap.in_flight);
    renderRuns(snap.runs);
    renderLlm(snap.llm);
    renderBriefing(snap.briefing);
    $("updated").textContent = "updated " + clock(new Date().toISOString());
  }

  function scheduleRefresh() {
    const r = state.refresh;
    const now = Date.now();
    if (!r.firstAsked) r.firstAsked = now;
    clearTimeout(r.timer);
    const wait = Math.max(0, Math.min(REFRESH_DEBOUNCE_MS, r.firstAsked + REFRESH_MAX_WAIT_MS - now));
    r.timer = setTimeout(runRefresh, wait);
  }

  async function runRefresh() {
    const r = state.refresh;
    r.timer = null;
    r.firstAsked = 0;
    if (r.running) {
      r.again = true;
      return;
    }
    r.running = true;
    try {
      applySnapshot(await fetchSnapshot());
    } catch (e) {
      console.warn("dashboard refresh failed:", e);
    } finally {
      r.running = false;
      if (r.again) {
        r.again = false;
        scheduleRefresh();
      }
    }
  }

  // ---- the live stream --------------------------------------------------

  function setLive(mode, text) {
    state.live = mode;
    document.body.dataset.live = mode;
    const pill = $("live");
    pill.className = "pill pill-" + mode;
    pill.textContent = text;
  }

  function notice(text) {
    const node = $("notice");
    node.textContent = text;
    node.hidden = !text;
  }

  function connect() {
    const source = new EventSource("/events?since=" + encodeURIComponent(state.shownSeq));
    state.source = source;
    source.addEventListener("open", () => {
      setLive("live", "live");
      notice("");
    });
    source.addEventListener("transition", (e) => {
      let t;
      try {
        t = JSON.parse(e.data);
      } catch (err) {
        console.warn("unreadable transition event:", e.data);
        return;
      }
      onTransition(t);
    });
    source.addEventListener("dropped", (e) => {
      // The server ended the stream (a slow client, or shutting down); the
      // browser reconnects with Last-Event-ID and the log fills the gap.
      stats.dropped += 1;
      let reason = "";
      try {
        reason = JSON.parse(e.data).reason || "";
      } catch (err) {
        reason = "";
      }
      notice("The stream was ended by the server" + (reason ? " (" + reason + ")" : "") + "; resuming from the log…");
    });
    source.addEventListener("reset", () => {
      // The service's log never reached what this page has shown: it now
      // runs on another database (a restart on the throwaway default). The
      // stream goes on from the new log's end; start the page over from a
      // snapshot of it.
      stats.resets += 1;
      state.counts = {};
      state.countsAsOf = 0;
      state.shownSeq = 0;
      state.titles.clear();
      $("transitions").replaceChildren();
      $("stream-empty").hidden = false;
      notice("The service's transition log was replaced (a restart on a new database?); showing the new one.");
      runRefresh();
    });
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) {
        // A refusal (e.g. not an event stream): the browser gives up, so
        // try again ourselves, resuming after what is already shown.
        setLive("down", "offline");
        source.close();
        stats.reconnects += 1;
        setTimeout(() => {
          if (state.source === source) connect();
        }, RECONNECT_MS);
      } else {
        setLive("reconnecting", "reconnecting…");
      }
    });
  }

  async function start() {
    try {
      applySnapshot(await fetchSnapshot());
      document.body.dataset.ready = "1";
    } catch (e) {
      notice("Could not load /dashboard.json: " + e.message + ". Retrying…");
      setTimeout(start, RECONNECT_MS);
      return;
    }
    connect();
    setInterval(tickLeases, 1000);
    setInterval(tickPause, 1000);
    // While the stream is down, the panels still follow the database.
    setInterval(() => {
      if (state.live !== "live") scheduleRefresh();
    }, POLL_WHILE_DOWN_MS);
    setInterval(() => {
      if (state.live === "live") scheduleRefresh();
    }, REFRESH_WHILE_LIVE_MS);
  }

  start();
})();
