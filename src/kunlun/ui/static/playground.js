// The Playground: a streaming chat through /ui/call (the daemon's /v1 API as the session's
// key), with a system prompt and the conversation so far sent on every turn. The user's text
// goes in with textContent; replies are drawn by renderMarkdown (markdown.js), which builds
// text nodes only: nothing a model writes becomes HTML.
"use strict";
const $ = (id) => document.getElementById(id);
let conversation = [];  // the turns so far: {role, content}

function messages(next) {
  const system = $("system").value.trim();
  return [...(system ? [{ role: "system", content: system }] : []), ...conversation,
          ...(next === undefined ? [] : [{ role: "user", content: next }])];
}

function body(next) {
  return {
    model: $("model").value,
    messages: messages(next),
    temperature: Number($("temperature").value),
    max_tokens: Number($("max_tokens").value),
    stream: true,
  };
}

function showCode() {
  const b = body($("prompt").value);
  const json = JSON.stringify(b, null, 2).replace(/'/g, "'\\''");
  $("curl").textContent =
    `curl -N ${location.origin}/v1/chat/completions \\\n` +
    `  -H "Authorization: Bearer $KUNLUN_API_KEY" -H "Content-Type: application/json" \\\n` +
    `  -d '${json}'`;
  $("python").textContent =
    "import os\nfrom openai import OpenAI\n\n" +
    `client = OpenAI(base_url="${location.origin}/v1", api_key=os.environ["KUNLUN_API_KEY"])\n` +
    "stream = client.chat.completions.create(\n" +
    `    model=${JSON.stringify(b.model)},\n` +
    `    messages=${JSON.stringify(b.messages, null, 4).replace(/\n/g, "\n    ")},\n` +
    `    temperature=${b.temperature}, max_tokens=${b.max_tokens}, stream=True,\n)\n` +
    "for chunk in stream:\n" +
    "    if chunk.choices:\n" +
    '        print(chunk.choices[0].delta.content or "", end="", flush=True)\n';
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("transcript").appendChild(div);
  return div;
}

function fail(message) {
  $("chat-error").textContent = message;
  $("chat-error").hidden = false;
}

async function send(event) {
  event.preventDefault();
  $("chat-error").hidden = true;
  const request = body($("prompt").value);
  showCode();
  const asked = $("prompt").value;
  bubble("user", asked);
  const reply = bubble("assistant", "");
  reply.dataset.chunks = "0";
  let text = "";
  $("send").disabled = true;
  try {
    const resp = await fetch("/ui/call/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      fail((err.error && err.error.message) || `HTTP ${resp.status}`);
      return;
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) fail(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          text += delta.content;
          reply.replaceChildren(renderMarkdown(text));
          reply.dataset.chunks = String(Number(reply.dataset.chunks) + 1);
        }
      }
    }
    conversation.push({ role: "user", content: asked }, { role: "assistant", content: text });
    $("turns").textContent = String(conversation.length / 2);
    $("prompt").value = "";
    reply.dataset.done = "1";
  } catch (e) {
    fail(String(e));
  } finally {
    $("send").disabled = false;
    showCode();
  }
}

function newChat() {
  conversation = [];
  $("transcript").replaceChildren();
  $("turns").textContent = "0";
  $("chat-error").hidden = true;
  showCode();
}

async function loadModels() {
  const resp = await fetch("/ui/call/v1/models");
  if (!resp.ok) { fail(`models: HTTP ${resp.status}`); return; }
  for (const m of (await resp.json()).data) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.id;
    $("model").appendChild(option);
  }
  showCode();
}

document.addEventListener("DOMContentLoaded", () => {
  $("chat").addEventListener("submit", send);
  $("new-chat").addEventListener("click", newChat);
  for (const id of ["model", "temperature", "max_tokens", "prompt", "system"]) {
    $(id).addEventListener("input", showCode);
  }
  loadModels();
});
