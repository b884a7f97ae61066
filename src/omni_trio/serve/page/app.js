// The voice page: one /v1/realtime session (OpenAI's Realtime API, GA events) with
// the microphone in, the answer's audio out, both transcripts, and barge-in.
//
// What it shows and played is also in the DOM, for people and for tests: each turn
// is a `.turn` with `data-item-id`, `data-status`, `data-played-ms` (the answer's
// audio played), `data-latency-ms` (your speech's end, or your message, to the
// answer's first audio) and, for an answer you spoke over, `data-stopped-after-ms`
// (from `speech_started` to its playback stopping) and `data-truncated`.

const RATE = 24000; // audio/pcm both ways: 16-bit mono at 24 kHz
const CHUNK = 960; // samples per append: 40 ms
const config = JSON.parse(document.getElementById("config").textContent);
// Errors after which the server closes the session.
const ENDING = new Set(["session_idle_timeout", "server_shutting_down"]);
const $ = (id) => document.getElementById(id);
const now = () => performance.now();

// -- what the page played ------------------------------------------------------------

class Player {
  constructor(ctx) {
    this.ctx = ctx;
    this.out = ctx.createGain();
    this.out.connect(ctx.destination);
    this.sources = new Set();
    this.end = 0; // when what is scheduled ends, on the context's clock
    this.items = new Map(); // item id -> [{start, duration}] of its chunks
    this.itemId = null; // the answer playing (or last played)
  }

  // Queue 24 kHz PCM16 after what is queued; returns when it starts (performance ms).
  play(itemId, pcm) {
    const ctx = this.ctx;
    const samples = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 0x8000;
    const buffer = ctx.createBuffer(1, samples.length, RATE);
    buffer.copyToChannel(samples, 0);
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.out);
    const start = Math.max(ctx.currentTime + 0.01, this.end);
    source.start(start);
    this.end = start + buffer.duration;
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
    if (!this.items.has(itemId)) this.items.set(itemId, []);
    this.items.get(itemId).push({ start, duration: buffer.duration });
    this.itemId = itemId;
    return now() + (start - ctx.currentTime) * 1000;
  }

  get playing() {
    return this.sources.size > 0 && this.ctx.currentTime < this.end;
  }

  playedMs(itemId) {
    const t = this.ctx.currentTime;
    let played = 0;
    for (const c of this.items.get(itemId) || []) {
      played += Math.min(Math.max(t - c.start, 0), c.duration);
    }
    return Math.floor(played * 1000);
  }

  // Stop at once; what was played of each chunk stays counted.
  stop() {
    const t = this.ctx.currentTime;
    for (const source of this.sources) source.stop();
    this.sources.clear();
    for (const chunks of this.items.values()) {
      for (const c of chunks) c.duration = Math.min(Math.max(t - c.start, 0), c.duration);
    }
    this.end = 0;
  }
}

// -- the microphone ----------------------------------------------------------------

class Mic {
  constructor(onChunk, onLevel) {
    this.onChunk = onChunk;
    this.onLevel = onLevel;
    this.stream = null;
  }

  async start(ctx) {
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    await ctx.audioWorklet.addModule("/page/capture.js");
    const source = ctx.createMediaStreamSource(this.stream);
    const node = new AudioWorkletNode(ctx, "omni-capture", {
      numberOfOutputs: 0,
      processorOptions: { chunk: CHUNK },
    });
    node.port.onmessage = (event) => {
      const pcm = new Int16Array(event.data);
      let peak = 0;
      for (let i = 0; i < pcm.length; i += 8) peak = Math.max(peak, Math.abs(pcm[i]));
      this.onLevel(peak / 0x8000);
      this.onChunk(pcm);
    };
    source.connect(node);
  }
}

// -- the page ------------------------------------------------------------------------

const page = {
  ws: null,
  ctx: null,
  player: null,
  mic: null,
  mode: "vad",
  talking: false, // push to talk: the button is held
  sentMs: 0, // audio appended on this session, ms: the server's audio clock
  sent: [], // [{endMs, at}] of recent appends: when each was captured
  turnEnd: null, // when the last turn ended (performance ms), for its latency
  firstAudio: new Set(), // answers whose first audio was timed
  responseId: null, // the response in progress
  retries: 0,
  events: 0, // client events sent
  refused: false,
  closing: false,
};
// For tests and the curious: every server event's type, in order, each barge-in, and
// the session as the server last described it.
window.omni = { events: [], bargeIns: [], session: null, page };

function status(state, text) {
  const el = $("status");
  el.dataset.state = state;
  el.textContent = text;
}

function banner(text) {
  const el = $("banner");
  el.textContent = text || "";
  el.hidden = !text;
}

function turn(role, itemId) {
  let el = itemId && document.querySelector(`.turn[data-item-id="${itemId}"]`);
  if (el) return el;
  el = document.createElement("div");
  el.className = `turn ${role}`;
  if (itemId) el.dataset.itemId = itemId;
  el.innerHTML = '<span class="text"></span><span class="meta"></span>';
  $("log").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function pendingUser() {
  return document.querySelector(".turn.user.pending") || turn("user");
}

function meta(el, text) {
  el.querySelector(".meta").textContent = text;
}

function send(event) {
  if (page.ws && page.ws.readyState === WebSocket.OPEN) {
    const text = JSON.stringify({ event_id: `page_${++page.events}`, ...event });
    if (text.length > config.limits.max_event_bytes) {
      banner(`Not sent: the server takes events of at most ${config.limits.max_event_bytes} bytes.`);
      return false;
    }
    page.ws.send(text);
    return true;
  }
  return false;
}

function session() {
  const speaks = config.speaks;
  const update = { type: "realtime", output_modalities: [speaks ? "audio" : "text"] };
  if (config.listens) {
    update.audio = { input: { turn_detection: page.mode === "vad" ? { type: "server_vad" } : null } };
  }
  if (speaks && $("voice").value) {
    update.audio = { ...(update.audio || {}), output: { voice: $("voice").value } };
  }
  return { type: "session.update", session: update };
}

function audioContext() {
  if (!page.ctx) {
    try {
      page.ctx = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
    } catch (err) {
      page.ctx = new AudioContext({ latencyHint: "interactive" });
    }
    page.player = new Player(page.ctx);
  }
  if (page.ctx.state === "suspended") page.ctx.resume();
  return page.ctx;
}

// The answer you spoke over (or typed over) stops at once, and the server is told
// what of it was played.
function interrupt(cause) {
  const player = page.player;
  if (!player || !player.playing) return;
  const at = now();
  const itemId = player.itemId;
  player.stop();
  const stoppedAfterMs = now() - at;
  const playedMs = player.playedMs(itemId);
  const el = turn("assistant", itemId);
  el.dataset.stoppedAfterMs = stoppedAfterMs.toFixed(1);
  el.dataset.playedMs = playedMs;
  send({ type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: playedMs });
  // every answer stopped, for tests and the curious
  window.omni.bargeIns.push({ cause, at, itemId, stoppedAfterMs, playedMs });
}

// When audio at `ms` on the session's clock was captured (performance ms).
function capturedAt(ms) {
  for (const chunk of page.sent) {
    if (chunk.endMs >= ms) return chunk.at - (chunk.endMs - ms);
  }
  return now();
}

function onChunk(pcm) {
  if (!page.ws || page.ws.readyState !== WebSocket.OPEN) return;
  if (page.mode === "ptt" && !page.talking) return;
  if (page.mode === "ptt" && page.talkedMs >= config.limits.max_buffer_seconds * 1000) {
    banner(`The server holds at most ${config.limits.max_buffer_seconds} s of audio in a turn: sent.`);
    release();
    return;
  }
  let binary = "";
  const bytes = new Uint8Array(pcm.buffer);
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  if (!send({ type: "input_audio_buffer.append", audio: btoa(binary) })) return;
  const ms = (pcm.length / RATE) * 1000;
  page.sentMs += ms;
  page.talkedMs = (page.talkedMs || 0) + ms;
  page.sent.push({ endMs: page.sentMs, at: now() });
  if (page.sent.length > 1500) page.sent.splice(0, 500); // a minute is plenty
}

function decode(base64) {
  const binary = atob(base64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

const handlers = {
  "session.created"(e) {
    page.retries = 0;
    window.omni.session = e.session;
    status("connected", `connected · ${config.listens ? (page.mode === "vad" ? "hands-free" : "push to talk") : "text"}`);
  },
  "session.updated"(e) {
    window.omni.session = e.session;
  },
  "input_audio_buffer.speech_started"(e) {
    interrupt("speech");
    const el = pendingUser();
    el.classList.add("pending");
    el.dataset.itemId = e.item_id;
    el.querySelector(".text").textContent = "…";
  },
  "input_audio_buffer.speech_stopped"(e) {
    page.turnEnd = capturedAt(e.audio_end_ms);
  },
  "input_audio_buffer.timeout_triggered"(e) {
    page.turnEnd = capturedAt(e.audio_end_ms);
  },
  "conversation.item.input_audio_transcription.completed"(e) {
    const el = turn("user", e.item_id);
    el.classList.remove("pending");
    el.querySelector(".text").textContent = e.transcript.trim() || "(nothing heard)";
  },
  "conversation.item.input_audio_transcription.failed"(e) {
    const el = turn("user", e.item_id);
    el.classList.remove("pending");
    el.querySelector(".text").textContent = `(not heard: ${e.error.message})`;
  },
  "response.created"(e) {
    page.responseId = e.response.id;
  },
  "response.output_item.added"(e) {
    turn("assistant", e.item.id).classList.add("pending");
  },
  "response.output_audio_transcript.delta"(e) {
    const el = turn("assistant", e.item_id);
    el.classList.remove("pending");
    el.querySelector(".text").textContent += e.delta;
  },
  "response.output_text.delta"(e) {
    handlers["response.output_audio_transcript.delta"](e);
    firstOutput(e.item_id);
  },
  "response.output_audio.delta"(e) {
    audioContext();
    const pcm = decode(e.delta);
    const starts = page.player.play(e.item_id, pcm);
    const el = turn("assistant", e.item_id);
    el.dataset.audioMs = Math.floor(Number(el.dataset.audioMs || 0) + (pcm.length / RATE) * 1000);
    if (!page.firstAudio.has(e.item_id)) {
      page.firstAudio.add(e.item_id);
      firstOutput(e.item_id, starts);
    }
  },
  "response.done"(e) {
    const response = e.response;
    page.responseId = null;
    for (const item of response.output || []) {
      const el = turn("assistant", item.id);
      el.classList.remove("pending");
      el.dataset.status = response.status;
      if (response.status === "failed" && response.status_details && response.status_details.error) {
        el.querySelector(".text").textContent ||= response.status_details.error.message;
      }
    }
  },
  "conversation.item.truncated"(e) {
    const el = turn("assistant", e.item_id);
    const text = el.querySelector(".text");
    const full = text.textContent;
    const said = e.transcript ?? full;
    const rest = full.startsWith(said) ? full.slice(said.length) : "";
    text.textContent = said;
    if (rest.trim()) {  // what was not played: shown struck through, after the text
      const unsaid = document.createElement("span");
      unsaid.className = "unsaid";
      unsaid.textContent = rest;
      text.after(unsaid);
    }
    el.dataset.truncated = "true";
    el.dataset.playedMs = e.audio_end_ms;
    meta(el, `${el.querySelector(".meta").textContent} · cut at ${(e.audio_end_ms / 1000).toFixed(1)} s`);
  },
  error(e) {
    const error = e.error;
    banner(error.message);
    // The server ends the session after these: say why, and reconnect only when asked.
    if (ENDING.has(error.code)) page.ended = true;
    if (error.code === "server_overloaded" || error.code === "model_not_found") page.refused = true;
  },
};

// An answer's first output: its latency from the end of your turn.
function firstOutput(itemId, at = now()) {
  const el = turn("assistant", itemId);
  if (el.dataset.latencyMs || page.turnEnd === null) return;
  const latency = Math.max(0, at - page.turnEnd);
  el.dataset.latencyMs = latency.toFixed(0);
  meta(el, `${config.speaks ? "first audio" : "first word"} ${latency.toFixed(0)} ms after you stopped`);
}

function connect() {
  banner("");
  page.refused = false;
  page.ended = false;
  page.sentMs = 0;
  page.sent = [];
  page.firstAudio.clear();
  if (document.querySelector(".turn")) {
    const divider = document.createElement("div");
    divider.className = "divider";
    divider.textContent = "a new conversation";
    $("log").append(divider);
  }
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${scheme}//${location.host}/v1/realtime?model=${encodeURIComponent(config.model)}`);
  page.ws = ws;
  status("connecting", "connecting…");
  $("reconnect").hidden = true;
  ws.onopen = () => send(session());
  ws.onmessage = (message) => {
    const event = JSON.parse(message.data);
    window.omni.events.push(event.type);
    const handle = handlers[event.type];
    if (handle) handle(event);
  };
  ws.onclose = (close) => {
    if (page.ws !== ws) return;
    page.ws = null;
    if (page.player) page.player.stop();
    if (page.refused) {
      status("refused", "refused");
      if (close.reason && $("banner").hidden) banner(close.reason);
      $("reconnect").hidden = false;
      return;
    }
    status("closed", close.reason ? `closed: ${close.reason}` : "disconnected");
    $("reconnect").hidden = false;
    // A connection lost (no close from the server, or no reason given) is tried again,
    // three times; a session the server ended, with its reason, waits for the button.
    if (!page.closing && !page.ended && page.retries < 3) {
      page.retries += 1;
      const delay = 1000 * 2 ** (page.retries - 1);
      status("closed", `disconnected · reconnecting in ${delay / 1000} s`);
      setTimeout(() => page.ws === null && connect(), delay);
    }
  };
}

// While an answer plays, its turn says how much of it was played.
setInterval(() => {
  const player = page.player;
  if (!player || !player.itemId) return;
  const el = document.querySelector(`.turn[data-item-id="${player.itemId}"]`);
  if (el && !el.dataset.truncated) el.dataset.playedMs = player.playedMs(player.itemId);
}, 100);

// -- controls ------------------------------------------------------------------------

async function startMic() {
  if (page.mic) return;
  const button = $("mic");
  button.disabled = true;
  try {
    const ctx = audioContext();
    page.mic = new Mic(onChunk, (level) => ($("level").firstElementChild.style.width = `${Math.min(100, level * 300)}%`));
    await page.mic.start(ctx);
    button.textContent = "Microphone on";
  } catch (err) {
    page.mic = null;
    button.disabled = false;
    banner(`The microphone could not start: ${err.message}`);
  }
}

function hold() {
  if (page.talking) return;
  startMic();
  interrupt("push to talk");
  if (page.responseId) send({ type: "response.cancel" });
  send({ type: "input_audio_buffer.clear" });
  page.talking = true;
  page.talkedMs = 0;
  $("talk").classList.add("held");
  const el = turn("user");
  el.classList.add("pending");
  el.querySelector(".text").textContent = "…";
}

function release() {
  if (!page.talking) return;
  page.talking = false;
  $("talk").classList.remove("held");
  page.turnEnd = now();
  send({ type: "input_audio_buffer.commit" });
  send({ type: "response.create" });
}

$("mic").onclick = startMic;
$("reconnect").onclick = () => {
  page.retries = 0;
  connect();
};
$("mode").onchange = () => {
  page.mode = $("mode").value;
  $("talk").hidden = page.mode !== "ptt";
  send(session());
  status("connected", `connected · ${page.mode === "vad" ? "hands-free" : "push to talk"}`);
};
$("voice").onchange = () => send(session());
$("talk").onpointerdown = hold;
$("talk").onpointerup = release;
$("talk").onpointerleave = release;
document.addEventListener("keydown", (e) => {
  if (e.code === "Space" && page.mode === "ptt" && e.target.id !== "text" && !e.repeat) {
    e.preventDefault();
    hold();
  }
});
document.addEventListener("keyup", (e) => {
  if (e.code === "Space" && page.mode === "ptt" && e.target.id !== "text") release();
});
$("say").onsubmit = (e) => {
  e.preventDefault();
  const text = $("text").value.trim();
  if (!text) return;
  audioContext();
  interrupt("text");
  if (page.responseId) send({ type: "response.cancel" });
  const item = { type: "message", role: "user", content: [{ type: "input_text", text }] };
  if (!send({ type: "conversation.item.create", item })) {
    banner("Not connected: reconnect first.");
    return;
  }
  send({ type: "response.create" });
  const el = turn("user");
  el.querySelector(".text").textContent = text;
  page.turnEnd = now();
  $("text").value = "";
};
window.addEventListener("beforeunload", () => (page.closing = true));

for (const voice of config.voices) {
  const option = document.createElement("option");
  option.value = option.textContent = voice;
  $("voice").append(option);
}
connect();
