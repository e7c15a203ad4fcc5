// The session timeline: polls the JSON API and draws each turn's calls as bars on a time axis.
"use strict";

const REFRESH_MS = 1000;
const CODES = ["ok", "TIMEOUT", "OUTCOME_UNKNOWN", "NOT_EXECUTED", "EXECUTION_ERROR", "INVALID_ARGUMENTS", "CANCELLED"];
let selected = decodeURIComponent(location.hash.slice(1));

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "style") Object.assign(node.style, value);
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function clock(ts) {
  return ts ? new Date(ts * 1000).toLocaleTimeString([], { hour12: false }) : "";
}

function seconds(value) {
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(value < 10 ? 2 : 1)} s`;
}

function short(text, keep) {
  return text && text.length > keep ? text.slice(0, keep - 1) + "…" : text || "";
}

async function fetchJson(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: ${response.status}`);
  return response.json();
}

function drawSessions(sessions) {
  const nav = document.getElementById("sessions");
  nav.replaceChildren(...sessions.map((s) => {
    const link = el("a", { href: "#" + encodeURIComponent(s.session_id), class: s.session_id === selected ? "active" : "" },
      el("span", { class: "id" }, s.session_id), el("span", { class: "when" }, clock(s.last_activity)));
    return link;
  }));
}

function legend() {
  const items = [["queued", "seg-queued"], ["waiting for a limit", "seg-waiting"], ["running", "seg-running"],
    ["earlier attempts", "seg-retrying"]]
    .concat(CODES.map((code) => [code, "code-" + code]))
    .concat([["sent while streaming", "code-ok eager"], ["message ended", "msg-end-key"]]);
  return el("div", { class: "legend" }, ...items.map(([text, cls]) => el("span", {}, el("i", { class: cls }), text)));
}

function turnBounds(turn, now) {
  let start = turn.dispatched_at || turn.started_at;
  let end = Math.max(start, turn.message_ended_at || start);
  if (turn.message_ended_at) start = Math.min(start, turn.message_ended_at);
  for (const call of turn.calls) {
    for (const t of [call.queued_at, call.first_started_at, call.started_at]) if (t) start = Math.min(start, t);
    end = Math.max(end, call.finished_at || (call.phase === "done" ? end : now));
  }
  return [start, Math.max(end - start, 0.05)];
}

function axis(span, marker) {
  const ticks = [];
  const step = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300].find((s) => span / s <= 8) || 600;
  for (let t = 0; t <= span + 1e-9; t += step) {
    ticks.push(el("span", { class: "tick", style: { left: `${(t / span) * 100}%` } }, t === 0 ? "0" : "+" + seconds(t)));
  }
  return el("div", { class: "axis" }, ...ticks, ...marker("message ended"));
}

// The streamed message's end as a vertical line through the axis and every call's track (none
// for a turn whose message was not streamed): calls sent early start left of it.
function endMarker(turn, start, span) {
  if (!turn.message_ended_at) return () => [];
  const at = ((turn.message_ended_at - start) / span) * 100;
  const title = `model message ended ${clock(turn.message_ended_at)}`;
  // The axis's label goes on the side with room: left of a line in the right half.
  const label = (text) => el("span", { class: "msg-end-label" + (at > 50 ? " before" : "") }, text);
  return (text) => [el("div", { class: "msg-end", title, style: { left: `${at}%` } }, ...(text ? [label(text)] : []))];
}

function segment(cls, from, to, start, span, title) {
  const left = ((from - start) / span) * 100;
  const width = Math.max(((to - from) / span) * 100, 0);
  return el("div", { class: "bar " + cls, title, style: { left: `${left}%`, width: `${width}%` } });
}

function callRow(call, start, span, now, marker) {
  const state = call.phase === "done" ? call.code || "ok" : call.phase;
  const shown = call.phase === "waiting" ? `waiting: ${call.waiting_for}` : state;
  const label = el("div", { class: "label" },
    el("span", { class: "tool", title: `${call.tool} (${call.side_effect || "not in registry"})` }, call.tool),
    el("span", { class: "mono", title: call.call_id }, short(call.call_id, 18)),
    el("span", { title: "attempts" }, call.attempts ? "×" + call.attempts : ""),
    el("span", { class: "mono", title: call.worker || "" }, short(call.worker, 18)),
    el("span", { class: "code code-" + state, title: call.late_code ? `late result: ${call.late_code}` : shown },
      short(shown, 32)));
  const key = call.key ? `key ${call.key}` : "no key";
  const waited = call.waiting_for ? ` · waited for limit ${call.waiting_for} since ${clock(call.waiting_since)}` : "";
  const early = call.sent_early ? " · sent while streaming" : "";
  const title = `${call.tool} ${call.call_id} · ${shown} · ${key} · attempts ${call.attempts || 0} · ` +
    `${call.worker || "no worker"}${waited}${early}`;
  label.title = title;
  const track = el("div", { class: "track" + (call.sent_early ? " eager" : ""), title }, ...marker());
  const queued = call.queued_at || call.first_started_at || call.started_at;
  const started = call.started_at || (["queued", "waiting"].includes(call.phase) ? now : call.finished_at);
  const first = Math.min(call.first_started_at || started, started);
  // A call refused admission waits in the broker from its first refusal until a limit admits it.
  const waiting = call.waiting_since && call.waiting_since < first ? call.waiting_since : null;
  const queuedEnd = waiting && queued ? Math.max(queued, Math.min(waiting, first)) : first;
  if (queued && queuedEnd > queued) {
    track.append(segment("seg-queued", queued, queuedEnd, start, span, "queued " + seconds(queuedEnd - queued) + early));
  }
  if (waiting) {
    track.append(segment("seg-waiting", waiting, first, start, span,
      `waiting for limit ${call.waiting_for} ${seconds(first - waiting)} (since ${clock(waiting)})`));
  }
  if (first < started) track.append(segment("seg-retrying", first, started, start, span, "earlier attempts and backoff " + seconds(started - first)));
  if (call.started_at) {
    const end = call.phase === "done" && call.finished_at ? call.finished_at : now;
    const cls = call.phase === "done" ? "code-" + (call.code || "ok") : "seg-" + call.phase;
    track.append(segment(cls, call.started_at, Math.max(end, call.started_at), start, span,
      `${state} ${seconds(end - call.started_at)}${early}`));
  }
  return [label, track];
}

function drawTurn(turn, index, now) {
  const [start, span] = turnBounds(turn, now);
  const marker = endMarker(turn, start, span);
  const done = turn.calls.filter((c) => c.phase === "done").length;
  const head = el("h2", {}, `turn ${index + 1}`,
    el("span", { class: "meta" }, `${turn.turn_id.slice(0, 12)} · ${turn.calls.length} calls · ${done} done · ` +
      `dispatched ${clock(turn.dispatched_at || turn.started_at)} · ${seconds(span)}`));
  const grid = el("div", { class: "grid" },
    el("div", { class: "labels-head" }, el("span", {}, "tool"), el("span", {}, "call id"), el("span", {}, "tries"),
      el("span", {}, "worker"), el("span", {}, "result")),
    axis(span, marker));
  for (const call of turn.calls) grid.append(...callRow(call, start, span, now, marker));
  return el("section", { class: "turn", "data-turn": turn.turn_id }, head, grid);
}

function drawSession(view) {
  const main = document.getElementById("view");
  const calls = view.turns.reduce((n, t) => n + t.calls.length, 0);
  main.replaceChildren(el("h1", {}, `session ${view.session_id}`),
    el("p", { class: "hint" }, `${view.turns.length} turns · ${calls} calls`), legend(),
    ...view.turns.map((turn, i) => drawTurn(turn, i, view.now)));
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    drawSessions(await fetchJson("/api/sessions"));
    if (selected) drawSession(await fetchJson("/api/sessions/" + encodeURIComponent(selected)));
    status.textContent = "live · updated " + clock(Date.now() / 1000);
    document.body.dataset.updated = String(Date.now());
  } catch (error) {
    status.textContent = "cannot reach the server: " + error.message;
  }
}

window.addEventListener("hashchange", () => { selected = decodeURIComponent(location.hash.slice(1)); refresh(); });
refresh();
setInterval(refresh, REFRESH_MS);
