/*
 * p2pactor timeline dashboard: one lane per request, drawn on a canvas from
 * the websocket feed described in docs/timeline.md. Plain JavaScript, no
 * dependencies, no build step; works offline.
 *
 * Feeds: ws://<this host:port>/events by default; `?feeds=url1,url2` names
 * several (one per node in `p2pactor demo --dashboard`), merged into one view.
 * A feed URL may also be written as host:port (then /events is added).
 * `?peer=`, `?request=` and `?kinds=` on the page's URL are passed on to
 * every feed as the server-side filters of docs/timeline.md.
 *
 * Test hook (see p2pactor/surface/dashboard/README.md): window.p2pactorDashboard.
 */
(function () {
  "use strict";

  // ---------------------------------------------------------------------
  // Vocabulary
  // ---------------------------------------------------------------------

  const PHASES = {
    consumer: [
      ["registered", "registered", "#94a3b8"],
      ["probing", "probing", "#f59e0b"],
      ["fetch_sent", "fetching", "#3b82f6"],
      ["done", "done", "#16a34a"],
      ["failed", "failed", "#dc2626"],
      ["aborted", "aborted", "#9333ea"],
    ],
    producer: [
      ["open", "open", "#14b8a6"],
      ["closing", "closing", "#fb923c"],
      ["closed", "closed", "#64748b"],
    ],
  };
  const COLOR = {};
  const LABEL = {};
  for (const role of Object.keys(PHASES)) {
    for (const [phase, label, color] of PHASES[role]) {
      COLOR[phase] = color;
      LABEL[phase] = label;
    }
  }
  const UNKNOWN_COLOR = "#cbd5e1";
  const TERMINAL = new Set(["done", "failed", "aborted", "closed"]);
  const BAD_PHASES = new Set(["failed", "aborted"]);
  // Events that mean something went wrong: drawn as red marks.
  const BAD_KINDS = new Set([
    "Rejected", "SessionLost", "LookupTimedOut", "TransferFailed", "Aborted", "AbortSent",
    "LookupDropped", "PendingExpired", "ParentExpired",
  ]);

  const LABEL_W = 232; // px, the label column of the lanes canvas
  const ROW_H = 11; // px, one actor's sub-row
  const ROW_GAP = 2; // px between sub-rows of a lane
  const LANE_PAD = 5; // px above and below a lane's rows
  const TERMINAL_CAP = 7; // px, the block drawn after a terminal event
  const MARK_HIT_PX = 6; // px, how close the pointer must be to a mark
  const NAME_W = 112; // px, the request id in the label column
  const AUTO_W = 26; // px, the "auto" badge after it (the peer was chosen from summaries)
  const AUTO_COLOR = "#7c3aed";

  const now = () => Date.now() / 1000;

  // ---------------------------------------------------------------------
  // The store: every event of every feed, merged, grouped by request
  // ---------------------------------------------------------------------

  class Store {
    constructor() {
      this.clocks = new Map(); // node -> {wall, mono, firstAt}
      this.lanes = new Map(); // request -> lane
      this.actors = new Map(); // node + "\0" + actor -> actor
      this.arrival = 0; // events accepted so far (for pausing)
      this.events = 0;
      this.tMin = Infinity;
      this.tMax = -Infinity;
      this.gaps = []; // {feed, t, missed, arrival}
      this.missed = 0;
      this.truncated = 0;
      this.counters = new Map(); // node -> counters message
      this.peers = new Map(); // node -> {peers, received}
      this.structure = 0; // bumped when lanes or actors are added
      this.hosts = new Set();
      this.ports = new Set();
      this.blockLens = new Map(); // node -> bytes per block, when its hello says
      this.security = new Map(); // node -> "curve" | "none" | other, when its hello says
      this.derived = null;
    }

    /** Remember what a hello says of one node: its clock, block size, control security. */
    setNode(node) {
      if (!node || typeof node.node !== "string") return;
      this.setClock(node);
      const blockLen = Number(node.block_len);
      if (Number.isFinite(blockLen) && blockLen > 0) this.blockLens.set(node.node, blockLen);
      const security = securityOf(node);
      if (security != null) this.security.set(node.node, security);
    }

    setClock(node) {
      if (!node || typeof node.node !== "string") return;
      const old = this.clocks.get(node.node);
      this.clocks.set(node.node, {
        wall: Number(node.created_wall),
        mono: node.created_mono == null ? null : Number(node.created_mono),
        firstAt: old ? old.firstAt : null,
      });
    }

    /** An event's wall-clock time: created_wall + (at - created_mono). */
    wallOf(node, at) {
      let c = this.clocks.get(node);
      if (!c) {
        // A node no hello named: assume its event happened when it arrived.
        c = { wall: now(), mono: null, firstAt: at };
        this.clocks.set(node, c);
      }
      if (c.mono != null && Number.isFinite(c.mono)) return c.wall + (at - c.mono);
      // No monotonic origin: anchor the node's first event at created_wall.
      if (c.firstAt == null) c.firstAt = at;
      return c.wall + (at - c.firstAt);
    }

    lane(request) {
      let lane = this.lanes.get(request);
      if (!lane) {
        lane = {
          request,
          actors: [],
          kinds: new Set(),
          start: Infinity,
          end: -Infinity,
          arrival: this.arrival + 1,
          search: "",
          searchDirty: true,
          // Probed events whose data has a `source`: the node chose the peer itself.
          auto: [],
        };
        this.lanes.set(request, lane);
        this.structure++;
      }
      return lane;
    }

    /** Add one event message; false if it was a duplicate or malformed. */
    addEvent(m) {
      if (!m || typeof m.actor !== "string" || typeof m.node !== "string") return false;
      const request = typeof m.request === "string" ? m.request : m.actor;
      const key = m.node + "\0" + m.actor;
      let actor = this.actors.get(key);
      const seq = Number(m.seq);
      if (actor && actor.seqs.has(seq)) return false;
      const lane = this.lane(request);
      if (!actor) {
        const role = m.role === "producer" ? "producer" : "consumer";
        actor = {
          key,
          node: m.node,
          actor: m.actor,
          role,
          peer: m.peer || "",
          incarnation: m.incarnation || 0,
          events: [],
          seqs: new Set(),
          lane,
          arrival: this.arrival + 1,
        };
        this.actors.set(key, actor);
        lane.actors.push(actor);
        lane.actors.sort(compareActors);
        lane.searchDirty = true;
        this.hosts.add(hostOf(m.node));
        this.ports.add(m.node.slice(hostOf(m.node).length));
        this.structure++;
      }
      const at = Number(m.at);
      const e = {
        t: this.wallOf(m.node, at),
        at,
        seq,
        kind: String(m.kind || "?"),
        phase: m.phase == null ? null : String(m.phase),
        detail: m.detail == null ? "" : String(m.detail),
        data: m.data && typeof m.data === "object" ? m.data : {},
        arrival: ++this.arrival,
        actor,
      };
      actor.seqs.add(seq);
      const evs = actor.events;
      if (!evs.length || evs[evs.length - 1].seq < seq) {
        evs.push(e);
      } else {
        let i = evs.length;
        while (i > 0 && evs[i - 1].seq > seq) i--;
        evs.splice(i, 0, e);
      }
      if (!lane.kinds.has(e.kind)) {
        lane.kinds.add(e.kind);
        lane.searchDirty = true;
      }
      if (e.kind === "Probed" && sourceOf(e)) {
        lane.auto.push(e);
        lane.searchDirty = true;
      }
      if (e.t < lane.start) lane.start = e.t;
      if (e.t > lane.end) lane.end = e.t;
      if (e.t < this.tMin) this.tMin = e.t;
      if (e.t > this.tMax) this.tMax = e.t;
      this.events++;
      return true;
    }

    laneSearch(lane) {
      if (lane.searchDirty) {
        const parts = [lane.request];
        for (const a of lane.actors) {
          parts.push(a.node, a.peer, a.actor, a.role);
          const last = a.events[a.events.length - 1];
          if (last && last.phase) parts.push(last.phase, LABEL[last.phase] || "");
        }
        for (const k of lane.kinds) parts.push(k);
        for (const e of lane.auto) parts.push("auto", sourceOf(e).chosen);
        lane.search = parts.join(" ").toLowerCase();
        lane.searchDirty = false;
      }
      return lane.search;
    }

    sumCounters() {
      const keys = ["lookups", "keys_hit", "keys_missed", "pending", "expired", "fetches", "bytes", "failures"];
      const total = { nodes: this.counters.size };
      for (const k of keys) total[k] = 0;
      for (const c of this.counters.values()) {
        for (const k of keys) total[k] += Number(c[k]) || 0;
      }
      const keysSeen = total.keys_hit + total.keys_missed;
      total.hit_rate = keysSeen ? total.keys_hit / keysSeen : null;
      total.source = "node";
      return total;
    }

    /**
     * Counters and per-peer activity rebuilt from the events seen up to time t
     * (below the arrival cutoff): what replay shows at the slider's time, and
     * what a live page shows before the first `counters` message. The same
     * rules as the node's own counters (p2pactor/surface/timeline/feed.py Counters).
     */
    derive(t, cutoff) {
      const key = `${t}|${cutoff}|${this.events}`;
      if (this.derived && this.derived.key === key) return this.derived.value;
      const c = {
        lookups: 0, keys_hit: 0, keys_missed: 0, pending: 0, expired: 0,
        fetches: 0, blocks: 0, bytes: 0, failures: 0,
        // Bytes need each node's block size (a hello may say; recorded logs do not).
        bytes_known: this.clocks.size > 0 && [...this.clocks.keys()].every((n) => this.blockLens.has(n)),
      };
      const pairs = new Map(); // node + "\0" + peer -> {node, peer, consumer, producer, open, transfers}
      const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : 0);
      for (const a of this.actors.values()) {
        const loads = new Map(); // round -> blocks asked
        const writes = new Map(); // transfer -> blocks written
        const waiting = new Map(); // lookup -> keys still pending
        const blockLen = this.blockLens.get(a.node) || 0;
        let last = null;
        for (const e of a.events) {
          if (e.t > t || e.arrival > cutoff) continue;
          last = e;
          const d = e.data;
          switch (e.kind) {
            case "Probed":
              c.lookups++;
              break;
            case "LookupResp": {
              const hits = num(d.hits);
              c.keys_hit += hits;
              c.keys_missed += Math.max(0, num(d.keys) - hits);
              break;
            }
            case "FetchSent":
              c.fetches++;
              loads.set(d.round_seq, num(d.keys));
              break;
            case "TransferDone": {
              const blocks = loads.get(d.round_seq) || 0;
              loads.delete(d.round_seq);
              if (d.success) {
                c.blocks += blocks;
                c.bytes += blocks * blockLen;
              }
              break;
            }
            case "AbortAcked":
            case "Aborted":
              loads.delete(d.round_seq);
              break;
            case "Finished":
              if (d.phase !== "done") c.failures++;
              break;
            case "KeysResolved": {
              const before = waiting.get(d.lookup_id) || 0;
              const resolved = Math.min(before, num(d.hits) + num(d.misses));
              c.pending += resolved;
              const left = Math.max(before - resolved, num(d.pending));
              if (left) waiting.set(d.lookup_id, left);
              else waiting.delete(d.lookup_id);
              break;
            }
            case "PendingExpired": {
              const keys = num(d.keys);
              c.expired += keys;
              const before = waiting.get(d.lookup_id) || 0;
              if (before) waiting.set(d.lookup_id, Math.max(0, before - keys));
              break;
            }
            case "LookupAnswered":
            case "LookupDropped":
              waiting.delete(d.lookup_id);
              break;
            case "TransferStarted":
              writes.set(d.transfer_id, num(d.keys));
              break;
            case "TransferCompleted":
              writes.delete(d.transfer_id);
              break;
            case "TransferFailed":
              c.failures++;
              writes.delete(d.transfer_id);
              break;
            default:
              break;
          }
        }
        if (!last) continue;
        const pk = a.node + "\0" + a.peer;
        let p = pairs.get(pk);
        if (!p) {
          p = { node: a.node, peer: a.peer, consumer: 0, producer: 0, open: 0, transfers: 0 };
          pairs.set(pk, p);
        }
        p[a.role]++;
        if (!TERMINAL.has(last.phase)) {
          p.open++;
          p.transfers += a.role === "consumer" ? loads.size : writes.size;
        }
      }
      const keysSeen = c.keys_hit + c.keys_missed;
      c.hit_rate = keysSeen ? c.keys_hit / keysSeen : null;
      c.source = "events";
      const value = { counters: c, pairs: [...pairs.values()] };
      this.derived = { key, value };
      return value;
    }
  }

  function compareActors(a, b) {
    if (a.role !== b.role) return a.role === "consumer" ? -1 : 1;
    if (a.node !== b.node) return a.node < b.node ? -1 : 1;
    if (a.incarnation !== b.incarnation) return a.incarnation - b.incarnation;
    return a.actor < b.actor ? -1 : a.actor > b.actor ? 1 : 0;
  }

  /**
   * A node's control-channel security from its hello entry: "curve", "none",
   * or null when the feed does not say. Accepts `security` (docs/timeline.md)
   * and a few spellings a feed might use.
   */
  function securityOf(node) {
    for (const k of ["security", "control_security", "control", "auth"]) {
      const v = node[k];
      if (typeof v === "string" && v) return v.toLowerCase();
      if (v && typeof v === "object" && typeof v.security === "string") return v.security.toLowerCase();
    }
    if (typeof node.curve === "boolean") return node.curve ? "curve" : "none";
    return null;
  }

  function hostOf(node) {
    const i = node.lastIndexOf(":");
    return i > 0 ? node.slice(0, i) : node;
  }

  /** The last event of `actor` visible at time t, below the arrival cutoff. */
  function eventAt(actor, t, cutoff) {
    const evs = actor.events;
    for (let i = evs.length - 1; i >= 0; i--) {
      const e = evs[i];
      if (e.t <= t && e.arrival <= cutoff) return e;
    }
    return null;
  }

  /** A Probed event's automatic choice (docs/timeline.md: `data.source`), or null when named. */
  function sourceOf(e) {
    const s = e.data.source;
    return s && typeof s === "object" && typeof s.chosen === "string" ? s : null;
  }

  /** The lane's latest automatic choice visible at time t, below the arrival cutoff, or null. */
  function sourceAt(lane, t, cutoff) {
    let best = null;
    for (const e of lane.auto) {
      if (e.t <= t && e.arrival <= cutoff && (!best || e.t >= best.t)) best = e;
    }
    return best ? sourceOf(best) : null;
  }

  /** The phase of the lane's actors of one role at time t (the most recent actor wins). */
  function rolePhase(lane, role, t, cutoff) {
    let best = null;
    for (const a of lane.actors) {
      if (a.role !== role) continue;
      const e = eventAt(a, t, cutoff);
      if (e && (!best || e.t >= best.t)) best = e;
    }
    return best ? best.phase : null;
  }

  // ---------------------------------------------------------------------
  // Feeds: websocket connections with reconnection
  // ---------------------------------------------------------------------

  class Feed {
    constructor(url, app) {
      this.url = url;
      this.app = app;
      this.state = "connecting"; // connecting | open | retrying | error
      this.mode = null;
      this.version = null;
      this.nodes = [];
      this.hello = false;
      this.snapshot = false; // live: a snapshot arrived; replay: snapshot_end arrived
      this.messages = 0;
      this.eventsIn = 0;
      this.missed = 0;
      this.lastT = null;
      this.attempt = 0;
      this.retryAt = null;
      this.closeInfo = "";
      this.ws = null;
      this.timer = null;
    }

    label() {
      try {
        const u = new URL(this.url);
        return u.host;
      } catch (err) {
        return this.url;
      }
    }

    connect() {
      this.timer = null;
      this.state = "connecting";
      this.retryAt = null;
      this.hello = false;
      this.app.feedsChanged();
      let ws;
      try {
        ws = new WebSocket(this.url);
      } catch (err) {
        this.closeInfo = String(err && err.message ? err.message : err);
        this.retry();
        return;
      }
      this.ws = ws;
      ws.onopen = () => {
        this.state = "open";
        this.closeInfo = "";
        this.app.feedsChanged();
      };
      ws.onmessage = (msg) => {
        let m;
        try {
          m = JSON.parse(msg.data);
        } catch (err) {
          return;
        }
        this.messages++;
        this.app.handle(this, m);
      };
      ws.onerror = () => {
        this.closeInfo = "connection error";
      };
      ws.onclose = (ev) => {
        if (this.ws !== ws) return;
        this.ws = null;
        if (ev.code === 1013) this.closeInfo = "closed by the node: too slow (1013)";
        else if (ev.code !== 1006 || !this.closeInfo)
          this.closeInfo = `closed (${ev.code}${ev.reason ? ": " + ev.reason : ""})`;
        this.retry();
      };
    }

    retry() {
      this.attempt++;
      const base = Math.min(10, 0.5 * Math.pow(2, this.attempt - 1));
      const delay = base * (0.8 + 0.4 * Math.random());
      this.state = this.attempt > 1 && !this.everOpened ? "error" : "retrying";
      this.retryAt = now() + delay;
      this.timer = setTimeout(() => this.connect(), delay * 1000);
      this.app.feedsChanged();
    }

    gotHello() {
      this.hello = true;
      this.everOpened = true;
      this.attempt = 0;
    }
  }

  // ---------------------------------------------------------------------
  // The page
  // ---------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);

  class App {
    constructor() {
      this.store = new Store();
      this.params = new URLSearchParams(location.search);
      this.feeds = feedUrls(this.params).map((u) => new Feed(u, this));
      this.mode = null;
      this.filter = (this.params.get("filter") || "").trim();
      this.paused = false;
      this.cutoff = Infinity; // arrival cutoff while paused
      this.pausedAt = null;
      this.zoom = "fit"; // "fit" | seconds | "manual"
      this.manual = null; // {t0, t1}
      this.stick = true; // keep the newest lanes in view
      this.replayT = null; // slider time in replay mode
      this.replayUserSet = false;
      this.playing = null;
      this.selected = null; // request
      this.hover = null;
      this.layout = { lanes: [], offsets: [0], height: 0, key: "" };
      this.rendered = { t0: 0, t1: 1 };
      this.frame = 0;
      this.stats = { draws: 0, lastDrawMs: 0, maxDrawMs: 0, visibleLanes: 0, layoutMs: 0 };
      this.autoBadges = [];
      this.sideDirty = true;
      this.feedsDirty = true;
      this.lastSide = 0;
      this.noticeText = "";
    }

    start() {
      this.bindUi();
      this.renderLegend();
      if (!this.feeds.length) {
        this.setNotice("No feed to connect to: open this page from a p2pactor node or replay server, or pass ?feeds=ws://HOST:PORT/events.");
      }
      for (const f of this.feeds) f.connect();
      // Live views move with time; side panels refresh a few times a second.
      setInterval(() => {
        if (this.mode !== "replay" && !this.paused) this.requestDraw();
        this.sideDirty = true;
        this.requestDraw();
      }, 500);
      this.requestDraw();
    }

    // --- messages ------------------------------------------------------

    handle(feed, m) {
      switch (m.type) {
        case "hello":
          feed.gotHello();
          feed.mode = m.mode === "replay" ? "replay" : "live";
          feed.version = m.version;
          feed.nodes = Array.isArray(m.nodes) ? m.nodes.map((n) => n.node) : [];
          for (const n of m.nodes || []) this.store.setNode(n);
          this.securityDirty = true;
          if (this.mode == null || feed.mode === "replay") this.setMode(feed.mode);
          if (m.version !== 1) this.setNotice(`Feed ${feed.label()} speaks version ${m.version}; this page understands version 1.`);
          break;
        case "snapshot":
          for (const e of m.events || []) this.addEvent(feed, e);
          if (m.truncated) this.store.truncated += Number(m.truncated) || 0;
          if (feed.mode !== "replay") feed.snapshot = true;
          break;
        case "snapshot_end":
          feed.snapshot = true;
          if (this.mode === "replay" && !this.replayUserSet) this.replayT = this.store.tMax;
          break;
        case "event":
          this.addEvent(feed, m);
          break;
        case "peers":
          this.store.peers.set(m.node, { peers: Array.isArray(m.peers) ? m.peers : [], received: now() });
          this.sideDirty = true;
          break;
        case "counters":
          this.store.counters.set(m.node, m);
          this.sideDirty = true;
          break;
        case "gap": {
          const missed = Number(m.missed) || 0;
          feed.missed += missed;
          this.store.missed += missed;
          const t = feed.lastT != null ? feed.lastT : now();
          this.store.gaps.push({ feed: feed.label(), t, missed, arrival: this.store.arrival });
          break;
        }
        default:
          return; // unknown types are ignored: newer servers may add some
      }
      this.feedsDirty = true;
      this.requestDraw();
    }

    addEvent(feed, e) {
      if (this.store.addEvent(e)) {
        feed.eventsIn++;
        this.sideDirty = true;
        const actor = this.store.actors.get(e.node + "\0" + e.actor);
        const last = actor && actor.events[actor.events.length - 1];
        if (last && (feed.lastT == null || last.t > feed.lastT)) feed.lastT = last.t;
        if (this.selected === e.request) this.sideDirty = true;
      }
    }

    setMode(mode) {
      this.mode = mode;
      document.body.dataset.mode = mode;
      const badge = $("mode");
      badge.textContent = mode;
      badge.className = "badge " + mode;
      $("replay-bar").hidden = mode !== "replay";
      $("pause").hidden = mode === "replay";
      if (mode === "replay") {
        this.paused = false;
        this.cutoff = Infinity;
        // Sorting by start keeps a recorded run's lanes in time order.
      }
    }

    feedsChanged() {
      this.feedsDirty = true;
      this.requestDraw();
    }

    // --- state helpers ---------------------------------------------------

    connected() {
      return this.feeds.length > 0 && this.feeds.every((f) => f.state === "open" && f.hello);
    }

    ready() {
      return this.connected() && this.feeds.every((f) => f.snapshot);
    }

    /** The time lanes are drawn up to: the slider in replay, now (or the pause) live. */
    viewTime() {
      if (this.mode === "replay") return this.replayT == null ? this.store.tMax : this.replayT;
      if (this.paused) return this.pausedAt;
      return Math.max(now(), this.store.tMax);
    }

    pause() {
      if (this.mode === "replay" || this.paused) return;
      this.paused = true;
      this.cutoff = this.store.arrival;
      this.pausedAt = Math.max(now(), this.store.tMax);
      this.syncPauseButton();
      this.requestDraw();
    }

    resume() {
      if (!this.paused) return;
      this.paused = false;
      this.cutoff = Infinity;
      this.pausedAt = null;
      this.syncPauseButton();
      this.requestDraw();
    }

    syncPauseButton() {
      const b = $("pause");
      if (this.paused) {
        const fresh = this.store.arrival - this.cutoff;
        b.textContent = fresh > 0 ? `Resume (${fresh} new)` : "Resume";
        b.classList.add("active");
      } else {
        b.textContent = "Pause";
        b.classList.remove("active");
      }
      const badge = $("mode");
      if (this.mode === "live") {
        badge.textContent = this.paused ? "paused" : "live";
        badge.className = "badge " + (this.paused ? "paused" : "live");
      }
    }

    setFilter(q) {
      this.filter = String(q || "").trim();
      if ($("filter").value !== this.filter) $("filter").value = this.filter;
      this.requestDraw();
    }

    setTime(t) {
      if (this.mode !== "replay") return;
      const lo = this.store.tMin;
      const hi = this.store.tMax;
      if (!Number.isFinite(lo)) return;
      this.replayT = Math.min(hi, Math.max(lo, Number(t)));
      this.replayUserSet = true;
      this.sideDirty = true;
      this.sideUrgent = true;
      this.requestDraw();
    }

    // --- layout ------------------------------------------------------------

    laneRows(lane) {
      let c = 0;
      let p = 0;
      for (const a of lane.actors) {
        if (a.role === "consumer") c++;
        else p++;
      }
      return Math.max(1, c) + Math.max(1, p);
    }

    /** Visible lanes in order, with their y offsets; recomputed only when needed. */
    computeLayout() {
      const s = this.store;
      // Replay shows the lanes of the requests started by the slider's time: scrubbing
      // back makes the later ones go away, as they were not there yet.
      const until = this.mode === "replay" ? this.viewTime() : Infinity;
      const key = `${s.structure}|${this.filter}|${this.cutoff}|${s.actors.size}|${until}`;
      const filterMoves = this.filter && s.arrival !== this.layout.arrival;
      if (this.layout.key === key && !filterMoves) return this.layout;
      const t0 = performance.now();
      const terms = this.filter.toLowerCase().split(/\s+/).filter(Boolean);
      const lanes = [];
      for (const lane of s.lanes.values()) {
        if (lane.arrival > this.cutoff || lane.start > until) continue;
        if (terms.length) {
          const text = s.laneSearch(lane);
          if (!terms.every((w) => text.includes(w))) continue;
        }
        lanes.push(lane);
      }
      lanes.sort((a, b) => a.start - b.start || (a.request < b.request ? -1 : a.request > b.request ? 1 : 0));
      const offsets = new Array(lanes.length + 1);
      let y = 0;
      for (let i = 0; i < lanes.length; i++) {
        offsets[i] = y;
        const rows = this.laneRows(lanes[i]);
        y += rows * ROW_H + (rows - 1) * ROW_GAP + 2 * LANE_PAD;
      }
      offsets[lanes.length] = y;
      this.layout = { lanes, offsets, height: y, key, arrival: s.arrival };
      this.stats.layoutMs = performance.now() - t0;
      return this.layout;
    }

    laneIndexAt(y) {
      const off = this.layout.offsets;
      let lo = 0;
      let hi = this.layout.lanes.length - 1;
      if (hi < 0 || y < 0 || y >= this.layout.height) return -1;
      while (lo < hi) {
        const mid = (lo + hi + 1) >> 1;
        if (off[mid] <= y) lo = mid;
        else hi = mid - 1;
      }
      return lo;
    }

    /** The x range of the view, in wall-clock seconds. */
    timeRange() {
      const s = this.store;
      if (this.zoom === "manual" && this.manual) return this.manual;
      if (!Number.isFinite(s.tMin)) {
        const t = now();
        return { t0: t - 10, t1: t };
      }
      if (this.zoom === "fit" || this.mode === "replay") {
        if (this.zoom !== "fit" && this.mode === "replay") {
          const w = Number(this.zoom);
          const end = this.viewTime();
          return { t0: end - w * 0.85, t1: end + w * 0.15 };
        }
        let span = s.tMax - s.tMin;
        if (span <= 0) span = 0.01;
        const pad = span * 0.03;
        return { t0: s.tMin - pad, t1: s.tMax + pad };
      }
      const w = Number(this.zoom);
      const end = this.viewTime();
      return { t0: end - w, t1: end + w * 0.02 };
    }

    // --- drawing -------------------------------------------------------------

    requestDraw() {
      if (this.frame) return;
      this.frame = requestAnimationFrame(() => {
        this.frame = 0;
        this.draw();
      });
    }

    /** Draw everything now; returns the milliseconds it took. */
    draw() {
      const t0 = performance.now();
      const layout = this.computeLayout();
      const scroller = $("scroller");
      const spacer = $("spacer");
      if (spacer.style.height !== layout.height + "px") spacer.style.height = layout.height + "px";
      // Follow the newest lanes (live), or the latest started by the slider's time
      // (replay), unless the user scrolled up.
      if (this.stick && !this.paused) {
        const bottom = Math.max(0, layout.height - scroller.clientHeight);
        if (Math.abs(scroller.scrollTop - bottom) > 1) scroller.scrollTop = bottom;
      }
      this.drawLanes(layout);
      this.drawAxis();
      if (this.feedsDirty) this.renderFeeds();
      // Side panels (counters, peers, details) redraw at most 5 times a second while
      // events stream in, at once when the user moved the view's time.
      if (this.sideDirty) {
        const wait = this.sideUrgent ? 0 : 200 - (performance.now() - this.lastSide);
        if (wait <= 0) {
          this.sideUrgent = false;
          this.lastSide = performance.now();
          this.renderSide();
        } else if (!this.sideTimer) {
          this.sideTimer = setTimeout(() => {
            this.sideTimer = 0;
            this.requestDraw();
          }, wait);
        }
      }
      if (this.mode === "replay") this.syncSlider();
      if (this.paused) this.syncPauseButton();
      this.renderNotice();
      if (this.securityDirty) this.renderSecurity();
      const body = document.body.dataset;
      body.lanes = String(this.store.lanes.size);
      body.connected = String(this.connected());
      body.ready = String(this.ready());
      $("empty").style.display = layout.lanes.length ? "none" : "flex";
      $("empty").textContent = this.store.lanes.size
        ? this.filter ? "No lane matches the filter." : "No request has started by this time."
        : this.connected() ? "Connected; no request events yet." : "Waiting for the feed\u2026";
      const ms = performance.now() - t0;
      this.stats.draws++;
      this.stats.lastDrawMs = ms;
      if (ms > this.stats.maxDrawMs) this.stats.maxDrawMs = ms;
      return ms;
    }

    sizeCanvas(canvas, w, h) {
      const dpr = window.devicePixelRatio || 1;
      const W = Math.max(1, Math.round(w * dpr));
      const H = Math.max(1, Math.round(h * dpr));
      if (canvas.width !== W || canvas.height !== H) {
        canvas.width = W;
        canvas.height = H;
        canvas.style.width = w + "px";
        canvas.style.height = h + "px";
      }
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      return ctx;
    }

    drawLanes(layout) {
      const scroller = $("scroller");
      const canvas = $("lanes");
      const w = scroller.clientWidth; // without the scrollbar
      const h = scroller.clientHeight;
      const ctx = this.sizeCanvas(canvas, w, h);
      ctx.clearRect(0, 0, w, h);
      const range = this.timeRange();
      this.rendered = { t0: range.t0, t1: range.t1, w, h };
      const plotW = Math.max(10, w - LABEL_W - 8);
      const x = (t) => LABEL_W + ((t - range.t0) / (range.t1 - range.t0)) * plotW;
      const tView = this.viewTime();
      const cutoff = this.cutoff;
      const top = scroller.scrollTop;
      const first = Math.max(0, this.laneIndexAt(top));
      let visible = 0;
      this.autoBadges = []; // lanes drawn with the "auto" badge (the test hook reads them)

      ctx.font = "12px system-ui, sans-serif";
      ctx.textBaseline = "middle";
      for (let i = first; i < layout.lanes.length; i++) {
        const y0 = layout.offsets[i] - top;
        if (y0 > h) break;
        const lane = layout.lanes[i];
        const y1 = layout.offsets[i + 1] - top;
        visible++;
        // Background: zebra, hover and selection.
        if (lane.request === this.selected) ctx.fillStyle = "#dbeafe";
        else if (this.hover && this.hover.lane === lane) ctx.fillStyle = "#eef2ff";
        else ctx.fillStyle = i % 2 ? "#fafbfc" : "#ffffff";
        ctx.fillRect(0, y0, w, y1 - y0);
        ctx.fillStyle = "#eef0f3";
        ctx.fillRect(0, y1 - 1, w, 1);

        const rows = this.rowsOf(lane);
        const started = lane.start <= tView;
        // Label: a dot in the consumer's phase, the request id, then one tag per row.
        const cPhase = rolePhase(lane, "consumer", tView, cutoff);
        const midY = (y0 + y1) / 2;
        ctx.beginPath();
        ctx.arc(10, midY, 4, 0, Math.PI * 2);
        ctx.fillStyle = cPhase ? COLOR[cPhase] || UNKNOWN_COLOR : "#e5e7eb";
        ctx.fill();
        ctx.fillStyle = started ? "#111827" : "#9ca3af";
        ctx.font = "600 12px system-ui, sans-serif";
        const source = sourceAt(lane, tView, cutoff);
        const name = ellipsize(ctx, lane.request, source ? NAME_W - AUTO_W - 4 : NAME_W);
        ctx.fillText(name, 20, midY);
        if (source) {
          drawAutoBadge(ctx, 20 + ctx.measureText(name).width + 4, midY);
          this.autoBadges.push(lane.request);
        }
        ctx.font = "10px ui-monospace, monospace";
        for (let r = 0; r < rows.length; r++) {
          const ry = y0 + LANE_PAD + r * (ROW_H + ROW_GAP);
          const { role, actor } = rows[r];
          const tag = role === "consumer" ? "C" : "P";
          ctx.fillStyle = role === "consumer" ? "#1d4ed8" : "#0f766e";
          ctx.fillText(tag, 138, ry + ROW_H / 2);
          ctx.fillStyle = "#6b7280";
          const where = actor ? shortNode(actor.node, this.store) : "\u2014";
          ctx.fillText(ellipsizeLeft(ctx, where, LABEL_W - 152), 148, ry + ROW_H / 2);
        }
        ctx.font = "12px system-ui, sans-serif";

        // Rows: phase segments, then event marks.
        ctx.save();
        ctx.beginPath();
        ctx.rect(LABEL_W, y0, plotW + 8, y1 - y0);
        ctx.clip();
        for (let r = 0; r < rows.length; r++) {
          const actor = rows[r].actor;
          if (!actor) continue;
          const ry = y0 + LANE_PAD + r * (ROW_H + ROW_GAP);
          this.drawActor(ctx, actor, ry, x, tView, cutoff, range);
        }
        ctx.restore();
      }
      this.stats.visibleLanes = visible;

      // Gap markers and the time line (now or the slider).
      ctx.save();
      ctx.beginPath();
      ctx.rect(LABEL_W, 0, plotW + 8, h);
      ctx.clip();
      for (const g of this.store.gaps) {
        if (g.arrival > cutoff) continue;
        const gx = Math.round(x(g.t)) + 0.5;
        ctx.strokeStyle = "rgba(220,38,38,0.7)";
        ctx.setLineDash([4, 3]);
        ctx.beginPath();
        ctx.moveTo(gx, 0);
        ctx.lineTo(gx, h);
        ctx.stroke();
        ctx.setLineDash([]);
      }
      if (this.mode === "replay" || (this.zoom !== "fit" && Number.isFinite(tView))) {
        const tx = Math.round(x(tView)) + 0.5;
        ctx.strokeStyle = this.mode === "replay" ? "#4f46e5" : "rgba(17,24,39,0.35)";
        ctx.lineWidth = this.mode === "replay" ? 1.5 : 1;
        ctx.beginPath();
        ctx.moveTo(tx, 0);
        ctx.lineTo(tx, h);
        ctx.stroke();
        ctx.lineWidth = 1;
      }
      ctx.restore();
      ctx.fillStyle = "#e5e7eb";
      ctx.fillRect(LABEL_W - 4, 0, 1, h);
    }

    rowsOf(lane) {
      const rows = [];
      for (const role of ["consumer", "producer"]) {
        const of = lane.actors.filter((a) => a.role === role);
        if (!of.length) rows.push({ role, actor: null });
        for (const a of of) rows.push({ role, actor: a });
      }
      return rows;
    }

    drawActor(ctx, actor, ry, x, tView, cutoff, range) {
      const evs = actor.events;
      let prev = null;
      const h = ROW_H;
      const shown = [];
      for (const e of evs) {
        if (e.t > tView || e.arrival > cutoff) continue;
        shown.push(e);
      }
      if (!shown.length) return;
      // Segments: from each event to the next, in the phase after the event.
      for (let i = 0; i < shown.length; i++) {
        const e = shown[i];
        const next = shown[i + 1];
        const xa = x(e.t);
        if (next) {
          const xb = x(next.t);
          if (xb > LABEL_W && xa < LABEL_W + 100000) {
            ctx.fillStyle = COLOR[e.phase] || UNKNOWN_COLOR;
            ctx.fillRect(xa, ry + 1, Math.max(1, xb - xa), h - 2);
          }
        } else if (TERMINAL.has(e.phase)) {
          // A finished actor: a solid block in its final phase.
          ctx.fillStyle = COLOR[e.phase] || UNKNOWN_COLOR;
          ctx.fillRect(xa, ry, TERMINAL_CAP, h);
        } else {
          // Still in flight (as of tView): the bar runs up to the view's time.
          const xb = x(Math.min(tView, range.t1 + 1));
          ctx.fillStyle = COLOR[e.phase] || UNKNOWN_COLOR;
          ctx.fillRect(xa, ry + 1, Math.max(2, xb - xa), h - 2);
          ctx.fillStyle = "rgba(255,255,255,0.55)";
          ctx.fillRect(Math.max(xa, xb - 2), ry + 1, 2, h - 2);
        }
        prev = e;
      }
      // Marks: a tick per event; red for events that mean trouble.
      for (const e of shown) {
        const mx = Math.round(x(e.t)) + 0.5;
        if (mx < LABEL_W - 2) continue;
        const bad = BAD_KINDS.has(e.kind) || (e.kind === "Finished" && BAD_PHASES.has(e.phase));
        ctx.fillStyle = bad ? "#b91c1c" : "rgba(17,24,39,0.75)";
        ctx.fillRect(mx - 0.5, ry - 1, bad ? 2 : 1, h + 2);
        if (this.hover && this.hover.event === e) {
          ctx.strokeStyle = "#111827";
          ctx.strokeRect(mx - 3, ry - 2, 6, h + 4);
        }
      }
      return prev;
    }

    drawAxis() {
      const canvas = $("axis");
      const scroller = $("scroller");
      const w = scroller.clientWidth;
      const h = 28;
      const ctx = this.sizeCanvas(canvas, canvas.clientWidth || w, h);
      ctx.clearRect(0, 0, canvas.clientWidth || w, h);
      const { t0, t1 } = this.rendered;
      const plotW = Math.max(10, w - LABEL_W - 8);
      const span = t1 - t0;
      const x = (t) => LABEL_W + ((t - t0) / span) * plotW;
      ctx.fillStyle = "#6b7280";
      ctx.font = "11px system-ui, sans-serif";
      ctx.textBaseline = "middle";
      const lanes = this.layout.lanes.length;
      const total = this.store.lanes.size;
      const label = lanes === total ? `${total} request${total === 1 ? "" : "s"}` : `${lanes} of ${total} requests`;
      ctx.fillText(label, 10, h / 2);
      const step = niceStep(span / Math.max(1, plotW / 120));
      const startTick = Math.ceil(t0 / step) * step;
      ctx.strokeStyle = "#d1d5db";
      for (let t = startTick; t <= t1; t += step) {
        const tx = Math.round(x(t)) + 0.5;
        if (tx < LABEL_W) continue;
        ctx.beginPath();
        ctx.moveTo(tx, h - 7);
        ctx.lineTo(tx, h);
        ctx.stroke();
        ctx.fillStyle = "#374151";
        const text = formatTick(t, step);
        if (tx + 3 + ctx.measureText(text).width <= w) ctx.fillText(text, tx + 3, h / 2 - 2);
      }
      // Gap markers on the axis, with how many events were missed (close ones merged).
      ctx.font = "600 10px system-ui, sans-serif";
      const marks = [];
      for (const g of this.store.gaps) {
        if (g.arrival > this.cutoff) continue;
        const gx = x(g.t);
        if (gx < LABEL_W || gx > w) continue;
        marks.push([gx, g.missed]);
      }
      marks.sort((a, b) => a[0] - b[0]);
      const merged = [];
      for (const [gx, missed] of marks) {
        const last = merged[merged.length - 1];
        if (last && gx - last[0] < 90) last[1] += missed;
        else merged.push([gx, missed]);
      }
      ctx.fillStyle = "#dc2626";
      for (const [gx, missed] of merged) {
        const text = `\u26a0 ${missed} missed`;
        const tw = ctx.measureText(text).width;
        ctx.fillText(text, gx + 3 + tw > w ? gx - 3 - tw : gx + 3, h - 6);
      }
    }

    // --- side panels, counters, feeds ---------------------------------------------

    renderFeeds() {
      this.feedsDirty = false;
      const box = $("feeds");
      const html = this.feeds
        .map((f) => {
          const cls = f.state === "open" ? (f.hello ? "open" : "connecting") : f.state;
          let text = f.label();
          let title = `${f.url}\nstate: ${f.state}`;
          if (f.nodes.length) title += `\nnodes: ${f.nodes.join(", ")}`;
          title += `\nevents: ${f.eventsIn}, messages: ${f.messages}`;
          if (f.missed) title += `\nmissed (gaps): ${f.missed}`;
          if (f.closeInfo) title += `\nlast close: ${f.closeInfo}`;
          if (f.state === "retrying" || f.state === "error") {
            const s = Math.max(0, f.retryAt - now());
            text += ` \u00b7 retry ${s.toFixed(0)}s`;
          } else if (f.state === "open" && f.mode === "replay" && !f.snapshot) {
            text += " \u00b7 loading";
          }
          return `<span class="feed ${cls}" data-state="${esc(f.state)}" title="${esc(title)}"><span class="dot"></span>${esc(text)}</span>`;
        })
        .join("");
      if (box.innerHTML !== html) box.innerHTML = html;
      if (this.mode == null) $("mode").textContent = this.feeds.some((f) => f.state === "retrying" || f.state === "error") ? "offline" : "connecting";
    }

    /**
     * The control channel's security, as each node's hello says: a loud badge when
     * any node runs it unauthenticated ("none"), a quiet one when all use CURVE.
     */
    renderSecurity() {
      this.securityDirty = false;
      const badge = $("security");
      const all = [...this.store.security];
      const open = all.filter(([, v]) => v === "none").map(([n]) => n);
      const curve = all.filter(([, v]) => v === "curve").map(([n]) => n);
      let state = "unknown";
      if (open.length) {
        state = "none";
        badge.textContent = "\u26a0 unauthenticated control channel";
        badge.className = "badge security insecure";
        badge.title =
          `The ZeroMQ control channel of ${open.join(", ")} is not authenticated: any host that ` +
          "can reach its port may speak for a peer. Configure curve_secret_key and curve_trusted.";
        badge.hidden = false;
      } else if (curve.length && curve.length === all.length) {
        state = "curve";
        badge.textContent = "\u2713 CURVE";
        badge.className = "badge security secure";
        badge.title = `The control channel of ${curve.join(", ")} is authenticated and encrypted with CURVE.`;
        badge.hidden = false;
      } else {
        badge.hidden = true;
        badge.textContent = "";
      }
      document.body.dataset.security = state;
    }

    renderSide() {
      this.sideDirty = false;
      this.renderCounters();
      this.renderPeers();
      this.renderDetails();
    }

    renderCounters() {
      const items = [];
      const s = this.store;
      const tView = this.viewTime();
      const derived = s.derive(tView, this.cutoff);
      // Live: the nodes' own counters (they see every event, not just the history a
      // snapshot holds); replay, or before the first report: rebuilt from the events.
      const fromNodes = this.mode !== "replay" && s.counters.size > 0;
      const c = fromNodes ? s.sumCounters() : derived.counters;
      const asOf = fromNodes ? "reported by the nodes" : this.mode === "replay" ? "at the slider's time, from the events" : "from the events received";
      items.push(["lookups", fmtInt(c.lookups), "info", `Lookups sent by this node's requests (${asOf})`]);
      items.push(["hit rate", c.hit_rate == null ? "\u2013" : (100 * c.hit_rate).toFixed(1) + "%", "good", `Keys the peers answered hit, of all keys looked up: ${fmtInt(c.keys_hit)} of ${fmtInt(c.keys_hit + c.keys_missed)}`]);
      items.push(["pending", fmtInt(c.pending), c.pending ? "warn" : "", "Pending keys (still being written at a lookup) that resolved later"]);
      items.push(["expired", fmtInt(c.expired), c.expired ? "warn" : "", "Pending keys that ran out of time and were answered miss"]);
      items.push(["fetches", fmtInt(c.fetches), "info", "Fetch rounds sent"]);
      if (fromNodes || c.bytes_known) items.push(["bytes", fmtBytes(c.bytes), "info", "Bytes loaded by fetches that succeeded"]);
      else items.push(["blocks", fmtInt(c.blocks), "info", "Blocks loaded by fetches that succeeded (the logs do not say the block size)"]);
      items.push(["failures", fmtInt(c.failures), c.failures ? "bad" : "good", "Requests that ended failed or aborted, and failed writes"]);
      items.push(null);
      // Requests by phase (as of the view's time in replay).
      let inflight = 0;
      let done = 0;
      let bad = 0;
      let shown = 0;
      for (const lane of s.lanes.values()) {
        if (lane.arrival > this.cutoff) continue;
        const p = rolePhase(lane, "consumer", tView, this.cutoff);
        if (p == null) continue;
        shown++;
        if (p === "done") done++;
        else if (BAD_PHASES.has(p)) bad++;
        else inflight++;
      }
      items.push(["requests", fmtInt(this.mode === "replay" ? shown : s.lanes.size), "", this.mode === "replay" ? `Requests started by the slider's time, of ${fmtInt(s.lanes.size)}` : "Requests (lanes) seen"]);
      items.push(["in flight", fmtInt(inflight), inflight ? "info" : "", "Requests not finished yet"]);
      items.push(["done", fmtInt(done), "good", "Requests that finished done"]);
      items.push(["failed/aborted", fmtInt(bad), bad ? "bad" : "good", "Requests that finished failed or aborted"]);
      items.push(["events", fmtInt(s.events), "", "Events received"]);
      if (s.missed) items.push(["missed (gaps)", fmtInt(s.missed), "bad", "Events the node dropped for this page (it fell behind)"]);
      const html = items
        .map((it) =>
          it == null
            ? '<div class="group-sep"></div>'
            : `<div class="counter ${it[2]}" data-counter="${esc(it[0])}" title="${esc(it[3] || "")}"><div class="value">${esc(it[1])}</div><div class="label">${esc(it[0])}</div></div>`,
        )
        .join("");
      const box = $("counters");
      if (box.innerHTML !== html) box.innerHTML = html;
    }

    renderPeers() {
      const s = this.store;
      const rows = [];
      if (s.peers.size) {
        rows.push("<table><thead><tr><th>peer</th><th>state</th><th>dialect</th><th title=\"transfers in flight\">xfers</th><th title=\"last activity\">active</th></tr></thead><tbody>");
        const nodes = [...s.peers.keys()].sort();
        for (const node of nodes) {
          const entry = s.peers.get(node);
          const stale = now() - entry.received > 3;
          rows.push(`<tr class="node-row"><td colspan="5">${esc(node)}${stale ? ' <span class="muted">(stale)</span>' : ""}</td></tr>`);
          if (!entry.peers.length) rows.push('<tr><td colspan="5" class="muted">no peers</td></tr>');
          for (const p of entry.peers) {
            const state = String(p.state || "?");
            let active = "";
            if (p.last_activity != null) {
              const wall = s.wallOf(node, Number(p.last_activity));
              active = fmtAgo(now() - wall);
            }
            const peer = String(p.peer || "");
            const shown = hostOf(peer) === hostOf(node) ? peer.slice(hostOf(peer).length) : peer;
            rows.push(
              `<tr><td title="${esc(peer)}">${esc(shown)}</td><td><span class="state ${esc(state)}">${esc(state)}</span></td>` +
                `<td>${esc(p.dialect || "")}</td><td>${esc(p.transfers ?? "")}</td><td>${esc(active)}</td></tr>`,
            );
          }
        }
        rows.push("</tbody></table>");
      } else if (s.actors.size) {
        // Replay (or before the first report): the peers seen in the events, as of the
        // view's time: actors still open and their transfers in flight.
        const pairs = s.derive(this.viewTime(), this.cutoff).pairs;
        const note = this.mode === "replay" ? "From the recorded events, at the slider's time." : "From the events (no peer report yet).";
        rows.push(`<p class="muted small">${note}</p>`);
        rows.push('<table><thead><tr><th>peer</th><th title="requests this node made of the peer (consumer actors)">asked</th><th title="requests this node served the peer (producer actors)">served</th><th title="actors not finished">open</th><th title="transfers in flight">xfers</th></tr></thead><tbody>');
        const byNode = new Map();
        for (const c of pairs) {
          if (!byNode.has(c.node)) byNode.set(c.node, []);
          byNode.get(c.node).push(c);
        }
        for (const node of [...byNode.keys()].sort()) {
          rows.push(`<tr class="node-row"><td colspan="5">${esc(node)}</td></tr>`);
          for (const c of byNode.get(node).sort((x, y) => (x.peer < y.peer ? -1 : 1))) {
            const shown = hostOf(c.peer) === hostOf(node) ? c.peer.slice(hostOf(c.peer).length) : c.peer;
            rows.push(
              `<tr><td title="${esc(c.peer)}">${esc(shown)}</td><td>${c.consumer}</td><td>${c.producer}</td>` +
                `<td>${c.open ? `<span class="state handshaking">${c.open}</span>` : "0"}</td><td>${c.transfers}</td></tr>`,
            );
          }
        }
        if (!pairs.length) rows.push('<tr><td colspan="5" class="muted">no request has started yet</td></tr>');
        rows.push("</tbody></table>");
      } else {
        rows.push('<p class="muted">No peer reports yet.</p>');
      }
      const html = rows.join("");
      const box = $("peers");
      if (box.innerHTML !== html) box.innerHTML = html;
    }

    renderDetails() {
      const box = $("details");
      const title = $("details-title");
      const lane = this.selected != null ? this.store.lanes.get(this.selected) : null;
      if (!lane) {
        title.textContent = "";
        const html = '<p class="muted">Click a lane to list its events. Hover a mark for details.</p>';
        if (box.innerHTML !== html) box.innerHTML = html;
        return;
      }
      title.textContent = lane.request;
      const tView = this.viewTime();
      const evs = [];
      for (const a of lane.actors) for (const e of a.events) if (e.arrival <= this.cutoff) evs.push(e);
      evs.sort((a, b) => a.t - b.t || a.seq - b.seq);
      const rows = [];
      for (const a of lane.actors) {
        const e = eventAt(a, tView, this.cutoff);
        const phase = e ? e.phase : null;
        rows.push(
          `<div class="small"><b>${a.role}</b> <code>${esc(a.actor)}</code> on ${esc(a.node)} ` +
            `${phase ? chip(phase) : '<span class="muted">not started</span>'}</div>`,
        );
      }
      const source = sourceAt(lane, tView, this.cutoff);
      if (source) rows.push(`<div class="small auto-source">${sourceHtml(source)}</div>`);
      rows.push("<table><thead><tr><th>+ms</th><th></th><th>kind</th><th>detail</th></tr></thead><tbody>");
      for (const e of evs) {
        const future = e.t > tView;
        rows.push(
          `<tr style="${future ? "opacity:0.35" : ""}"><td>${((e.t - lane.start) * 1000).toFixed(1)}</td>` +
            `<td>${e.actor.role === "consumer" ? "C" : "P"}</td><td>${esc(e.kind)}</td>` +
            `<td class="wrap">${esc(e.detail)}</td></tr>`,
        );
      }
      rows.push("</tbody></table>");
      const html = rows.join("");
      if (box.innerHTML !== html) box.innerHTML = html;
    }

    renderLegend() {
      const parts = [];
      for (const role of ["consumer", "producer"]) {
        parts.push(`<div class="role">${role}</div>`);
        for (const [phase, label, color] of PHASES[role]) {
          parts.push(`<div><span class="sw" style="background:${color}"></span>${esc(label)}</div>`);
        }
      }
      parts.push('<div class="role">marks</div>');
      parts.push('<div><span class="sw" style="background:#111827;width:2px"></span>event</div>');
      parts.push('<div><span class="sw" style="background:#b91c1c;width:3px"></span>trouble / gap</div>');
      parts.push('<div class="role">source</div>');
      parts.push('<div><span class="auto">auto</span> chosen from the peers\' summaries</div>');
      $("legend").innerHTML = parts.join("");
    }

    setNotice(text) {
      this.noticeText = text;
    }

    renderNotice() {
      const parts = [];
      if (this.noticeText) parts.push(this.noticeText);
      if (this.store.missed) parts.push(`\u26a0 ${this.store.missed} events were missed (the page fell behind the feed); lanes may be incomplete.`);
      if (this.store.truncated) parts.push(`The snapshot left out ${this.store.truncated} older events of finished requests.`);
      if (this.paused) parts.push("Paused: the view is frozen; new events are collected and shown on resume.");
      const text = parts.join("  ");
      const box = $("notice");
      if (box.textContent !== text) box.textContent = text;
      box.hidden = !text;
    }

    syncSlider() {
      const s = this.store;
      const slider = $("slider");
      const label = $("slider-time");
      if (!Number.isFinite(s.tMin)) {
        label.textContent = "loading\u2026";
        return;
      }
      const t = this.viewTime();
      const span = s.tMax - s.tMin || 1;
      const v = String(Math.round(((t - s.tMin) / span) * 10000));
      if (slider.value !== v && !this.sliding) slider.value = v;
      label.textContent = `${formatClock(t, 3)}  +${fmtDuration(t - s.tMin)} / ${fmtDuration(s.tMax - s.tMin)}`;
    }

    // --- interaction -----------------------------------------------------

    bindUi() {
      const filter = $("filter");
      filter.value = this.filter;
      filter.addEventListener("input", () => this.setFilter(filter.value));
      $("pause").addEventListener("click", () => (this.paused ? this.resume() : this.pause()));
      const zoom = $("zoom");
      zoom.addEventListener("change", () => {
        this.zoom = zoom.value === "fit" ? "fit" : zoom.value === "manual" ? "manual" : Number(zoom.value);
        this.requestDraw();
      });
      document.addEventListener("keydown", (ev) => {
        if (ev.target && (ev.target.tagName === "INPUT" || ev.target.tagName === "SELECT")) return;
        if (ev.key === " ") {
          ev.preventDefault();
          if (this.mode === "replay") this.togglePlay();
          else if (this.paused) this.resume();
          else this.pause();
        } else if (ev.key === "Escape") {
          this.selected = null;
          this.sideDirty = this.sideUrgent = true;
          this.requestDraw();
        } else if (ev.key === "f") {
          this.setZoom("fit");
        }
      });

      const scroller = $("scroller");
      scroller.addEventListener("scroll", () => {
        this.stick = scroller.scrollTop + scroller.clientHeight >= scroller.scrollHeight - 4;
        this.requestDraw();
      });
      let drag = null;
      scroller.addEventListener("mousedown", (ev) => {
        if (ev.button !== 0) return;
        drag = { x: ev.clientX, range: this.timeRange(), moved: false };
      });
      window.addEventListener("mouseup", (ev) => {
        if (drag && !drag.moved) this.click(ev);
        drag = null;
        scroller.classList.remove("dragging");
      });
      window.addEventListener("mousemove", (ev) => {
        if (drag) {
          const dx = ev.clientX - drag.x;
          if (Math.abs(dx) > 3) drag.moved = true;
          if (drag.moved) {
            scroller.classList.add("dragging");
            const plotW = Math.max(10, scroller.clientWidth - LABEL_W - 8);
            const dt = (-dx / plotW) * (drag.range.t1 - drag.range.t0);
            this.setManual(drag.range.t0 + dt, drag.range.t1 + dt);
            this.hideTooltip();
            return;
          }
        }
        if (ev.target === scroller) this.hoverAt(ev);
        else if (this.hover) {
          this.hover = null;
          this.hideTooltip();
          this.requestDraw();
        }
      });
      scroller.addEventListener("mouseleave", () => {
        this.hover = null;
        this.hideTooltip();
        this.requestDraw();
      });
      scroller.addEventListener(
        "wheel",
        (ev) => {
          if (!(ev.ctrlKey || ev.metaKey || Math.abs(ev.deltaX) > Math.abs(ev.deltaY))) return;
          ev.preventDefault();
          const r = this.timeRange();
          const plotW = Math.max(10, scroller.clientWidth - LABEL_W - 8);
          const rect = scroller.getBoundingClientRect();
          if (ev.ctrlKey || ev.metaKey) {
            const frac = Math.min(1, Math.max(0, (ev.clientX - rect.left - LABEL_W) / plotW));
            const at = r.t0 + frac * (r.t1 - r.t0);
            const k = Math.exp(ev.deltaY * 0.002);
            this.setManual(at - (at - r.t0) * k, at + (r.t1 - at) * k);
          } else {
            const dt = (ev.deltaX / plotW) * (r.t1 - r.t0);
            this.setManual(r.t0 + dt, r.t1 + dt);
          }
        },
        { passive: false },
      );
      window.addEventListener("resize", () => this.requestDraw());

      const slider = $("slider");
      slider.addEventListener("input", () => {
        this.stopPlay();
        const s = this.store;
        if (!Number.isFinite(s.tMin)) return;
        this.setTime(s.tMin + (Number(slider.value) / 10000) * (s.tMax - s.tMin));
      });
      slider.addEventListener("pointerdown", () => (this.sliding = true));
      slider.addEventListener("pointerup", () => (this.sliding = false));
      $("play").addEventListener("click", () => this.togglePlay());
    }

    setZoom(z) {
      this.zoom = z;
      $("zoom").value = z === "fit" ? "fit" : String(z);
      this.requestDraw();
    }

    setManual(t0, t1) {
      if (!(t1 > t0)) return;
      this.zoom = "manual";
      this.manual = { t0, t1 };
      $("zoom").value = "manual";
      this.requestDraw();
    }

    togglePlay() {
      if (this.playing) {
        this.stopPlay();
        return;
      }
      const s = this.store;
      if (!Number.isFinite(s.tMin)) return;
      if (this.viewTime() >= s.tMax) this.replayT = s.tMin;
      const speedSel = $("speed").value;
      const speed = speedSel === "fit10" ? Math.max(1e-6, (s.tMax - s.tMin) / 10) : Number(speedSel);
      let last = performance.now();
      const step = (ts) => {
        if (!this.playing) return;
        const dt = (ts - last) / 1000;
        last = ts;
        this.replayT = Math.min(s.tMax, this.viewTime() + dt * speed);
        this.replayUserSet = true;
        this.sideDirty = this.sideUrgent = true;
        this.draw();
        if (this.replayT >= s.tMax) this.stopPlay();
        else this.playing = requestAnimationFrame(step);
      };
      this.playing = requestAnimationFrame(step);
      $("play").textContent = "\u275a\u275a Pause";
    }

    stopPlay() {
      if (this.playing) cancelAnimationFrame(this.playing);
      this.playing = null;
      $("play").textContent = "\u25b6 Play";
    }

    /** What is under the pointer: the lane, the sub-row's actor and the nearest mark. */
    pick(ev) {
      const scroller = $("scroller");
      const rect = scroller.getBoundingClientRect();
      const px = ev.clientX - rect.left;
      const py = ev.clientY - rect.top + scroller.scrollTop;
      const i = this.laneIndexAt(py);
      if (i < 0) return null;
      const lane = this.layout.lanes[i];
      const rows = this.rowsOf(lane);
      const r = Math.floor((py - this.layout.offsets[i] - LANE_PAD) / (ROW_H + ROW_GAP));
      const row = rows[Math.min(rows.length - 1, Math.max(0, r))];
      const hit = { lane, actor: row.actor, role: row.role, event: null, px, label: px < LABEL_W };
      if (row.actor && px >= LABEL_W - MARK_HIT_PX) {
        const { t0, t1, w } = this.rendered;
        const plotW = Math.max(10, w - LABEL_W - 8);
        const tView = this.viewTime();
        let best = MARK_HIT_PX + 1;
        for (const e of row.actor.events) {
          if (e.t > tView || e.arrival > this.cutoff) continue;
          const ex = LABEL_W + ((e.t - t0) / (t1 - t0)) * plotW;
          const d = Math.abs(ex - px);
          if (d <= best) {
            best = d;
            hit.event = e;
          }
        }
      }
      return hit;
    }

    hoverAt(ev) {
      const hit = this.pick(ev);
      const changed = (hit && hit.event) !== (this.hover && this.hover.event) || (hit && hit.lane) !== (this.hover && this.hover.lane);
      this.hover = hit;
      if (!hit) this.hideTooltip();
      else if (hit.event) this.showTooltip(ev, eventTooltip(hit.event, hit.lane));
      else if (hit.label) this.showTooltip(ev, laneTooltip(hit.lane, this.viewTime(), this.cutoff));
      else this.hideTooltip();
      if (changed) this.requestDraw();
    }

    click(ev) {
      const scroller = $("scroller");
      if (ev.target !== scroller) return;
      const hit = this.pick(ev);
      this.selected = hit ? (this.selected === hit.lane.request ? null : hit.lane.request) : null;
      this.sideDirty = this.sideUrgent = true;
      this.requestDraw();
    }

    showTooltip(ev, html) {
      const tip = $("tooltip");
      if (tip.innerHTML !== html) tip.innerHTML = html;
      tip.hidden = false;
      const pad = 14;
      const r = tip.getBoundingClientRect();
      let left = ev.clientX + pad;
      let top = ev.clientY + pad;
      if (left + r.width > window.innerWidth - 4) left = ev.clientX - r.width - pad;
      if (top + r.height > window.innerHeight - 4) top = ev.clientY - r.height - pad;
      tip.style.left = Math.max(4, left) + "px";
      tip.style.top = Math.max(4, top) + "px";
    }

    hideTooltip() {
      $("tooltip").hidden = true;
    }

    // --- the test hook ---------------------------------------------------------

    laneSummary(lane, tView) {
      let events = 0;
      for (const a of lane.actors) {
        for (const e of a.events) if (e.t <= tView && e.arrival <= this.cutoff) events++;
      }
      return {
        request: lane.request,
        consumerPhase: rolePhase(lane, "consumer", tView, this.cutoff),
        producerPhase: rolePhase(lane, "producer", tView, this.cutoff),
        events,
        start: lane.start,
        end: lane.end,
        source: sourceAt(lane, tView, this.cutoff),
        actors: lane.actors.map((a) => {
          const e = eventAt(a, tView, this.cutoff);
          return { actor: a.actor, role: a.role, node: a.node, peer: a.peer, phase: e ? e.phase : null };
        }),
      };
    }

    hook() {
      const app = this;
      return {
        version: 1,
        mode: () => app.mode,
        connected: () => app.connected(),
        ready: () => app.ready(),
        feeds: () =>
          app.feeds.map((f) => ({
            url: f.url,
            state: f.state,
            hello: f.hello,
            mode: f.mode,
            snapshot: f.snapshot,
            nodes: f.nodes.slice(),
            events: f.eventsIn,
            missed: f.missed,
            closeInfo: f.closeInfo,
          })),
        lanes: () => {
          const t = app.viewTime();
          return [...app.store.lanes.values()].filter((l) => l.arrival <= app.cutoff && l.start <= t).map((l) => app.laneSummary(l, t));
        },
        visibleLanes: () => app.computeLayout().lanes.map((l) => l.request),
        autoBadges: () => app.autoBadges.slice(),
        lane: (request) => {
          const lane = app.store.lanes.get(request);
          if (!lane) return null;
          const out = app.laneSummary(lane, app.viewTime());
          out.events = [];
          for (const a of lane.actors) {
            for (const e of a.events) {
              out.events.push({ node: a.node, actor: a.actor, role: a.role, seq: e.seq, at: e.at, t: e.t, kind: e.kind, phase: e.phase, detail: e.detail, data: e.data });
            }
          }
          out.events.sort((a, b) => a.t - b.t || a.seq - b.seq);
          return out;
        },
        counters: () => (app.mode !== "replay" && app.store.counters.size ? app.store.sumCounters() : app.store.derive(app.viewTime(), app.cutoff).counters),
        security: () => Object.fromEntries(app.store.security),
        securityBadge: () => {
          const b = $("security");
          return b.hidden ? null : b.textContent;
        },
        peers: () => Object.fromEntries([...app.store.peers].map(([n, p]) => [n, p.peers])),
        gaps: () => app.store.gaps.map((g) => ({ feed: g.feed, t: g.t, missed: g.missed })),
        replayStart: () => (Number.isFinite(app.store.tMin) ? app.store.tMin : null),
        replayEnd: () => (Number.isFinite(app.store.tMax) ? app.store.tMax : null),
        time: () => app.viewTime(),
        setTime: (t) => {
          app.stopPlay();
          app.setTime(t);
          app.draw();
          return app.viewTime();
        },
        setFilter: (q) => {
          app.setFilter(q);
          app.draw();
          return app.layout.lanes.length;
        },
        pause: () => app.pause(),
        resume: () => app.resume(),
        paused: () => app.paused,
        select: (request) => {
          app.selected = request;
          app.sideDirty = app.sideUrgent = true;
          app.draw();
        },
        redraw: () => {
          app.layout.key = ""; // force the layout too
          return app.draw();
        },
        scrollTo: (y) => {
          const t0 = performance.now();
          const sc = $("scroller");
          sc.scrollTop = y;
          app.stick = false;
          app.draw();
          return { ms: performance.now() - t0, top: sc.scrollTop, visibleLanes: app.stats.visibleLanes };
        },
        scrollHeight: () => $("scroller").scrollHeight,
        follow: () => {
          app.stick = true;
          app.draw();
          return $("scroller").scrollTop;
        },
        setZoom: (z) => {
          app.setZoom(z === "fit" ? "fit" : Number(z));
          app.draw();
          return app.timeRange();
        },
        scrollToLane: (request) => {
          const layout = app.computeLayout();
          const i = layout.lanes.findIndex((l) => l.request === request);
          if (i < 0) return false;
          const sc = $("scroller");
          const y = layout.offsets[i];
          if (y < sc.scrollTop || layout.offsets[i + 1] > sc.scrollTop + sc.clientHeight) {
            sc.scrollTop = Math.max(0, y - sc.clientHeight / 3);
          }
          app.stick = false;
          app.draw();
          return true;
        },
        eventPoint: (request, role, index) => {
          // Where (client coordinates) the index-th drawn mark of the lane's first actor of
          // `role` is; null when it is not on screen. For hovering it in tests.
          const layout = app.computeLayout();
          const i = layout.lanes.findIndex((l) => l.request === request);
          if (i < 0) return null;
          const lane = layout.lanes[i];
          const rows = app.rowsOf(lane);
          const r = rows.findIndex((row) => row.role === role && row.actor);
          if (r < 0) return null;
          const tView = app.viewTime();
          const evs = rows[r].actor.events.filter((e) => e.t <= tView && e.arrival <= app.cutoff);
          const e = evs[index < 0 ? evs.length + index : index];
          if (!e) return null;
          const sc = $("scroller");
          const rect = sc.getBoundingClientRect();
          const { t0, t1, w } = app.rendered;
          const plotW = Math.max(10, w - LABEL_W - 8);
          const x = rect.left + LABEL_W + ((e.t - t0) / (t1 - t0)) * plotW;
          const y = rect.top + layout.offsets[i] - sc.scrollTop + LANE_PAD + r * (ROW_H + ROW_GAP) + ROW_H / 2;
          if (y < rect.top || y > rect.bottom || x < rect.left || x > rect.right) return null;
          return { x, y, kind: e.kind, seq: e.seq };
        },
        stats: () => Object.assign({ lanes: app.store.lanes.size, events: app.store.events, shownLanes: app.layout.lanes.length }, app.stats),
      };
    }
  }

  // ---------------------------------------------------------------------
  // Helpers
  // ---------------------------------------------------------------------

  function feedUrls(params) {
    const pass = new URLSearchParams();
    for (const k of ["peer", "request", "kinds"]) {
      const v = params.get(k);
      if (v) pass.set(k, v);
    }
    const qs = pass.toString();
    const withFilters = (u) => (qs && !u.includes("?") ? u + "?" + qs : u);
    const list = params.get("feeds");
    if (list) {
      return list
        .split(",")
        .map((s) => s.trim())
        .filter(Boolean)
        .map((s) => {
          if (/^wss?:\/\//.test(s)) return withFilters(s);
          if (/^https?:\/\//.test(s)) return withFilters(s.replace(/^http/, "ws").replace(/\/?$/, "/events").replace(/\/events\/events$/, "/events"));
          return withFilters(`ws://${s.replace(/\/+$/, "")}/events`);
        });
    }
    if (location.protocol !== "http:" && location.protocol !== "https:") return [];
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return [withFilters(`${scheme}//${location.host}/events`)];
  }

  function esc(v) {
    return String(v).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  function chip(phase) {
    const color = COLOR[phase] || UNKNOWN_COLOR;
    return `<span class="chip" style="background:${color}">${esc(LABEL[phase] || phase)}</span>`;
  }

  function ellipsize(ctx, text, maxW) {
    if (ctx.measureText(text).width <= maxW) return text;
    let lo = 0;
    let hi = text.length;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (ctx.measureText(text.slice(0, mid) + "\u2026").width <= maxW) lo = mid;
      else hi = mid - 1;
    }
    return text.slice(0, lo) + "\u2026";
  }

  /** A node's name for the narrow label column: what tells the nodes apart. */
  function ellipsizeLeft(ctx, text, maxW) {
    if (ctx.measureText(text).width <= maxW) return text;
    let lo = 0;
    let hi = text.length;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (ctx.measureText("\u2026" + text.slice(text.length - mid)).width <= maxW) lo = mid;
      else hi = mid - 1;
    }
    return "\u2026" + text.slice(text.length - lo);
  }

  function shortNode(node, store) {
    const hosts = store.hosts;
    const ports = store.ports;
    const i = node.lastIndexOf(":");
    if (i > 0) {
      if (hosts.size <= 1) return "@" + node.slice(i);
      if (ports.size <= 1) return "@" + node.slice(0, i);
    }
    return "@" + node;
  }

  const STEPS = [];
  for (let e = -6; e <= 4; e++) for (const m of [1, 2, 5]) STEPS.push(m * Math.pow(10, e));
  STEPS.push(3600, 7200);

  function niceStep(raw) {
    for (const s of STEPS) if (s >= raw) return s;
    return STEPS[STEPS.length - 1];
  }

  function pad2(n) {
    return String(n).padStart(2, "0");
  }

  function formatClock(t, decimals) {
    // Round first: 19.99996 s shown to 0.1 s is 20.0, not 19.0.
    const scale = Math.pow(10, Math.max(0, decimals));
    const units = Math.round(t * scale);
    const whole = Math.floor(units / scale);
    const d = new Date(whole * 1000);
    let s = `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
    if (decimals > 0) s += "." + String(units - whole * scale).padStart(decimals, "0");
    return s;
  }

  function formatTick(t, step) {
    if (step >= 1) return formatClock(t, 0);
    return formatClock(t, Math.min(6, Math.max(1, Math.ceil(-Math.log10(step) - 1e-9))));
  }

  function fmtInt(n) {
    return Number(n || 0).toLocaleString("en-US");
  }

  function fmtBytes(n) {
    n = Number(n) || 0;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function fmtDuration(s) {
    if (!Number.isFinite(s)) return "\u2013";
    const a = Math.abs(s);
    if (a < 1e-3) return (s * 1e6).toFixed(0) + " \u00b5s";
    if (a < 1) return (s * 1e3).toFixed(a < 0.01 ? 2 : 1) + " ms";
    if (a < 120) return s.toFixed(a < 10 ? 3 : 1) + " s";
    return (s / 60).toFixed(1) + " min";
  }

  function fmtAgo(s) {
    if (!Number.isFinite(s)) return "";
    if (s < 1) return "now";
    return fmtDuration(s).replace(/\.\d+ s$/, " s") + " ago";
  }

  function fmtData(key, value, e) {
    if (value == null) return "\u2013";
    if (/deadline$/.test(key) && typeof value === "number") {
      return `${fmtDuration(value - e.at)} after the event`;
    }
    if (key === "bytes" && typeof value === "number") return fmtBytes(value);
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }

  function eventTooltip(e, lane) {
    const a = e.actor;
    const rows = [
      ["node", esc(a.node)],
      ["actor", `<code>${esc(a.actor)}</code>`],
      ["seq", String(e.seq)],
      ["time", `${formatClock(e.t, 3)} (+${fmtDuration(e.t - lane.start)} in the request)`],
    ];
    const keys = Object.keys(e.data);
    for (const k of keys) {
      const source = k === "source" ? sourceOf(e) : null;
      if (source) rows.push(...sourceRows(source));
      else rows.push([esc(k), esc(fmtData(k, e.data[k], e))]);
    }
    return (
      `<div><span class="kind">${esc(e.kind)}</span>${e.phase ? chip(e.phase) : ""}</div>` +
      (e.detail ? `<div class="detail">${esc(e.detail)}</div>` : "") +
      `<table>${rows.map(([k, v]) => `<tr><td>${k}</td><td>${v}</td></tr>`).join("")}</table>`
    );
  }

  /** An automatic choice as tooltip rows (label, html): the peer, every claim, why. */
  function sourceRows(source) {
    return [
      ["source", `<span class="auto">auto</span> ${esc(source.chosen)}, asked ${esc(source.keys)} key${source.keys === 1 ? "" : "s"}`],
      ["claims", claimsHtml(source)],
      ["reason", esc(source.reason == null ? "" : source.reason)],
    ];
  }

  /** Each peer's claimed run, best first: "peer: run". */
  function claimsHtml(source) {
    const claims = Array.isArray(source.claims) ? source.claims : [];
    if (!claims.length) return "\u2013";
    return claims.map((c) => `${esc(c && c.peer)}: ${esc(c && c.run)}`).join("<br>");
  }

  /** The automatic choice in one line, for the side panel. */
  function sourceHtml(source) {
    const claims = Array.isArray(source.claims) ? source.claims : [];
    const listed = claims.map((c) => `${esc(c && c.peer)}: ${esc(c && c.run)}`).join(", ");
    return (
      `<span class="auto">auto</span> source <b>${esc(source.chosen)}</b>` +
      (listed ? `; claims ${listed}` : "") +
      (source.reason ? ` <span class="muted">(${esc(source.reason)})</span>` : "")
    );
  }

  /** The canvas's "auto" badge, its left edge at x, centred on y. */
  function drawAutoBadge(ctx, x, y) {
    const font = ctx.font;
    const fill = ctx.fillStyle;
    ctx.fillStyle = AUTO_COLOR;
    ctx.beginPath();
    if (ctx.roundRect) ctx.roundRect(x, y - 6, AUTO_W, 12, 6);
    else ctx.rect(x, y - 6, AUTO_W, 12);
    ctx.fill();
    ctx.fillStyle = "#ffffff";
    ctx.font = "600 9px system-ui, sans-serif";
    ctx.textAlign = "center";
    ctx.fillText("auto", x + AUTO_W / 2, y + 0.5);
    ctx.textAlign = "left";
    ctx.font = font;
    ctx.fillStyle = fill;
  }

  function laneTooltip(lane, tView, cutoff) {
    const rows = lane.actors.map((a) => {
      const e = eventAt(a, tView, cutoff);
      return `<tr><td>${a.role}</td><td><code>${esc(a.actor)}</code><br>on ${esc(a.node)} ${e ? chip(e.phase) : "<i>not started</i>"}</td></tr>`;
    });
    const dur = lane.end - lane.start;
    const source = sourceAt(lane, tView, cutoff);
    return (
      `<div><span class="kind">${esc(lane.request)}</span>${source ? '<span class="auto">auto</span>' : ""}</div>` +
      `<div class="detail">${lane.actors.length} actor${lane.actors.length === 1 ? "" : "s"}, ${fmtDuration(dur)} from first to last event</div>` +
      `<table>${rows.join("")}</table>` +
      (source ? `<table>${sourceRows(source).map(([k, v]) => `<tr><td>${k}</td><td>${v}</td></tr>`).join("")}</table>` : "")
    );
  }

  // ---------------------------------------------------------------------

  const app = new App();
  window.p2pactorDashboard = app.hook();
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", () => app.start());
  else app.start();
})();
