// A small reader of Prometheus' text format: enough for vlmserve's counters and histograms.

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

// [{name, labels, value}] of every sample line.
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(LABEL)) {
      labels[key] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

// {model: {tokens, ttftSum, ttftCount}} from vlmserve's generation series.
export function perModel(samples) {
  const out = {};
  const get = (model) => (out[model] ??= { tokens: 0, ttftSum: 0, ttftCount: 0 });
  for (const { name, labels, value } of samples) {
    const model = labels.model ?? "";
    if (name === "vlmserve_output_tokens_total") get(model).tokens += value;
    else if (name === "vlmserve_time_to_first_token_seconds_sum") get(model).ttftSum += value;
    else if (name === "vlmserve_time_to_first_token_seconds_count") get(model).ttftCount += value;
  }
  return out;
}

// Rates between two readings taken `seconds` apart: tokens/s, and the TTFT of the requests
// that started in between (else the average since start).
export function rates(before, after, seconds) {
  const out = {};
  for (const [model, now] of Object.entries(after)) {
    const then = before?.[model] ?? now;
    const newFirsts = now.ttftCount - then.ttftCount;
    out[model] = {
      tokensPerSecond: seconds > 0 ? Math.max(0, now.tokens - then.tokens) / seconds : 0,
      recentTtft: newFirsts > 0 ? (now.ttftSum - then.ttftSum) / newFirsts : null,
      meanTtft: now.ttftCount > 0 ? now.ttftSum / now.ttftCount : null,
      tokens: now.tokens,
    };
  }
  return out;
}
