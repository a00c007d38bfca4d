// The engram console's only script: progressive enhancement. Every page works without it.
// - tables with class "nav-table": arrow keys (and j / k, Home, End) move between rows, Enter
//   opens the row's first link;
// - the erase form: its button is enabled once the confirmation matches the id.
"use strict";

function rowsOf(table) {
  return Array.from(table.tBodies[0] ? table.tBodies[0].rows : []);
}

function focusRow(rows, index) {
  if (index < 0 || index >= rows.length) return;
  rows.forEach(function (r, i) { r.tabIndex = i === index ? 0 : -1; });
  rows[index].focus();
}

function enhanceTable(table) {
  var rows = rowsOf(table);
  if (!rows.length) return;
  rows[0].tabIndex = 0; // one tab stop for the table; arrows move inside it
  table.addEventListener("keydown", function (event) {
    var row = event.target.closest("tr");
    var i = rows.indexOf(row);
    if (i < 0 || event.target !== row) return; // keys typed into a link or control are theirs
    var moves = { ArrowDown: i + 1, j: i + 1, ArrowUp: i - 1, k: i - 1, Home: 0, End: rows.length - 1 };
    if (event.key in moves) {
      event.preventDefault();
      focusRow(rows, moves[event.key]);
    } else if (event.key === "Enter") {
      var link = row.querySelector("a[href]");
      if (link) { event.preventDefault(); link.click(); }
    }
  });
  table.addEventListener("click", function (event) {
    var row = event.target.closest("tr");
    var i = rows.indexOf(row);
    if (i >= 0) rows.forEach(function (r, j) { r.tabIndex = j === i ? 0 : -1; });
  });
}

function enhanceConfirm(form) {
  var target = form.querySelector("[data-confirm-target]");
  var input = form.querySelector("[data-confirm-input]");
  var button = form.querySelector("[data-confirm-button]");
  if (!target || !input || !button) return;
  function check() {
    button.disabled = !target.value.trim() || input.value.trim() !== target.value.trim();
  }
  target.addEventListener("input", check);
  input.addEventListener("input", check);
  check();
}

document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("table.nav-table").forEach(enhanceTable);
  document.querySelectorAll("form[data-confirm-form]").forEach(enhanceConfirm);
});
