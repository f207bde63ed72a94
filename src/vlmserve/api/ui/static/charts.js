// Live line charts with uPlot (vendor/uPlot.iife.min.js, loaded by index.html): one chart per
// series of the timeline, redrawn in place at each reading, as wide as the page allows. uPlot
// sets its sizes through the CSSOM (element.style), which the page's CSP allows.

import { el } from "./dom.js";

const PALETTE = ["#2f6fde", "#d9480f", "#2b8a3e", "#ae3ec9", "#e67700", "#0c8599", "#c2255c"];
const HEIGHT = 170;
const MIN_SPAN_S = 30; // the time axis spans 30 s at least: no sub-second ticks at first

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function fmt(value) {
  if (value === null || value === undefined) return "—";
  const size = Math.abs(value);
  return size >= 100 ? value.toFixed(0) : size >= 1 ? value.toFixed(1) : value.toPrecision(2);
}

function options(chart, width) {
  const [muted, line] = [cssVar("--muted"), cssVar("--line")];
  const axis = { stroke: muted, grid: { stroke: line, width: 1 }, ticks: { stroke: line } };
  return {
    title: chart.title,
    width,
    height: HEIGHT,
    scales: {
      x: { time: true, range: (u, min, max) => [Math.min(min, max - MIN_SPAN_S), max] },
      y: { range: (u, min, max) => [0, Math.max(max, chart.floor ?? 1) * 1.1] },
    },
    axes: [axis, { ...axis, size: 56, values: (u, ticks) => ticks.map(fmt) }],
    series: [
      {},
      ...chart.lines.map((line, i) => ({
        label: line.label,
        stroke: PALETTE[i % PALETTE.length],
        width: 1.5,
        dash: line.label.endsWith(" p90") || line.label.endsWith(" waiting") ? [6, 4] : undefined,
        value: (u, v) => fmt(v),
        points: { size: 4 },
      })),
    ],
  };
}

const pointsIn = (chart) =>
  chart.lines.reduce((n, line) => n + line.values.filter((v) => v !== null).length, 0);

export class LiveCharts {
  constructor(grid) {
    this.grid = grid;
    this.plots = new Map(); // key -> {plot, figure, signature}
    new ResizeObserver(() => this.resize()).observe(grid);
  }

  width(figure) {
    return Math.max(240, Math.floor(figure.clientWidth || this.grid.clientWidth));
  }

  draw(charts) {
    const keys = new Set(charts.map((c) => c.key));
    for (const [key, held] of this.plots) {
      if (keys.has(key)) continue;
      held.plot.destroy();
      held.figure.remove();
      this.plots.delete(key);
    }
    for (const chart of charts) {
      const data = [chart.x, ...chart.lines.map((l) => l.values)];
      const signature = chart.lines.map((l) => l.label).join("\n");
      let held = this.plots.get(chart.key);
      if (held && held.signature !== signature) {
        held.plot.destroy();
        held.figure.replaceChildren();
        held.plot = null;
      }
      if (!held) {
        const figure = el("figure", { className: "chart", dataset: { chart: chart.key } });
        this.grid.append(figure);
        held = { figure, plot: null };
        this.plots.set(chart.key, held);
      }
      held.signature = signature;
      if (held.plot) held.plot.setData(data);
      else held.plot = new globalThis.uPlot(options(chart, this.width(held.figure)), data, held.figure);
      held.figure.dataset.points = String(pointsIn(chart));
    }
  }

  resize() {
    for (const { plot, figure } of this.plots.values()) {
      if (plot && figure.clientWidth) plot.setSize({ width: this.width(figure), height: HEIGHT });
    }
  }
}
