// Rialto console: the little script the pages use. Everything else is
// plain HTML forms; without this file the charts stay tables and the
// wallet button does nothing.
"use strict";

(function () {
  const palette = ["#1f5fbf", "#b3541e", "#2e7d32", "#7b3fa0", "#a11d4a", "#5f6b7a"];

  function drawChart(el) {
    const source = document.getElementById(el.dataset.chart);
    if (!source || typeof uPlot === "undefined") return;
    const data = JSON.parse(source.textContent);
    const series = [{}];
    const columns = [data.x];
    let counts = false;
    data.series.forEach(function (s, i) {
      // Counts (requests) get an axis of their own, on the right.
      counts = counts || s.count;
      series.push({
        label: s.label,
        scale: s.count ? "count" : "amount",
        stroke: palette[i % palette.length],
        width: 2,
        dash: s.count ? [6, 4] : undefined,
        points: { show: data.x.length < 40 },
      });
      columns.push(s.values);
    });
    const axes = [{}, { scale: "amount", label: data.unit }];
    if (counts) axes.push({ scale: "count", side: 1, label: "requests", grid: { show: false } });
    const width = Math.max(280, el.clientWidth || 600);
    const plot = new uPlot({
      width: width,
      height: 260,
      series: series,
      scales: { x: { time: true }, amount: { auto: true }, count: { auto: true } },
      axes: axes,
    }, columns, el);
    new ResizeObserver(function () {
      plot.setSize({ width: Math.max(280, el.clientWidth), height: 260 });
    }).observe(el);
  }

  async function walletSignIn(button) {
    const box = document.getElementById("wallet-form");
    const error = document.getElementById("wallet-error");
    const fail = function (message) { error.textContent = message; button.disabled = false; };
    error.textContent = "";
    if (!window.ethereum) {
      fail("No browser wallet found: install one (for example MetaMask) and reload.");
      return;
    }
    button.disabled = true;
    try {
      const accounts = await window.ethereum.request({ method: "eth_requestAccounts" });
      const address = accounts[0];
      const csrf = box.dataset.csrf;
      const post = async function (url, fields) {
        const response = await fetch(url, {
          method: "POST",
          headers: { "Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json" },
          body: new URLSearchParams(fields).toString(),
          credentials: "same-origin",
        });
        let body = {};
        try { body = await response.json(); } catch (_) { /* an HTML refusal */ }
        if (!response.ok) throw new Error(body.error || "The console refused the sign-in (" + response.status + ")");
        return body;
      };
      const challenge = await post("/console/login/wallet/message", { address: address, csrf: csrf });
      const hex = "0x" + Array.from(new TextEncoder().encode(challenge.message))
        .map(function (b) { return b.toString(16).padStart(2, "0"); }).join("");
      const signature = await window.ethereum.request({ method: "personal_sign", params: [hex, address] });
      const done = await post("/console/login/wallet", {
        address: address, message: challenge.message, signature: signature, csrf: csrf,
      });
      window.location.assign(done.redirect);
    } catch (e) {
      fail(e && e.message ? e.message : String(e));
    }
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-chart]").forEach(drawChart);
    const wallet = document.getElementById("wallet-login");
    if (wallet) wallet.addEventListener("click", function () { walletSignIn(wallet); });
  });
})();
