// `weave predict --report` opened in a real browser: headless Chromium (Debian's), driven by
// playwright-core (npm, pinned by tools/dev). The page must render without a console error or a
// request leaving the file, draw a lane for every device and stream the step's Chrome trace has,
// list a layer node's tasks when the node is clicked (the trace's tasks of that device, stream,
// layer and phase), list the critical path `weave predict --critical-path` prints, and chart
// every device's memory over the step peaking at what the command line prints. Then
// `weave train --report` of a short run: its page charts each device's memory over the step,
// peaking at the figures train measured and printed, and lists the critical path on the wall
// clock that `weave train --critical-path` printed after training. Each check leaves a screenshot
// in the output folder.
//
//   node report_test.mjs WEAVE PLAYWRIGHT_CORE_DIR OUT_DIR
//
// Without Chromium or playwright-core it exits 77 (ctest's skip) saying to run tools/dev test, or
// fails when WEAVE_REQUIRE_BROWSER or CI is set: CI installs both, so there a skip would hide a
// broken install.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

const [weave, playwrightDir, outDir] = process.argv.slice(2);
if (!weave || !playwrightDir || !outDir) {
  console.error('usage: node report_test.mjs WEAVE PLAYWRIGHT_CORE_DIR OUT_DIR');
  process.exit(2);
}
const chromiumPath = '/usr/bin/chromium';

function missing(what) {
  const required = process.env.WEAVE_REQUIRE_BROWSER || process.env.CI;
  console.error(`${what} is missing: run tools/dev test, which installs Debian's chromium and ` +
                `playwright-core from npm (CI does)${required ? '' : '; skipping the browser test'}`);
  process.exit(required ? 1 : 77);
}
if (!fs.existsSync(chromiumPath)) missing(chromiumPath);
let chromium;
try {
  chromium = createRequire(import.meta.url)(path.resolve(playwrightDir)).chromium;
} catch (e) {
  missing(`playwright-core in ${playwrightDir}`);
}

const failures = [];
function check(ok, message) {
  if (!ok) failures.push(message);
  return ok;
}

fs.rmSync(outDir, { recursive: true, force: true });
fs.mkdirSync(outDir, { recursive: true });
const report = path.resolve(outDir, 'step.html');
const traceFile = path.join(outDir, 'step.trace.json');

// A small step with every kind of lane: tensor-parallel, expert-parallel (Ampipe's chunks) and
// pipeline streams on 8 devices (data-parallel replicas folded into the first).
const flags = [
  'predict', '--num-layers', '4', '--hidden-size', '64', '--num-attention-heads', '4',
  '--ffn-hidden-size', '128', '--seq-length', '64', '--num-experts', '4', '--moe-layer-freq', '2',
  '--devices', '8', '--tensor-model-parallel-size', '2', '--sequence-parallel',
  '--expert-model-parallel-size', '2', '--pipeline-model-parallel-size', '2',
  '--ampipe-degree', '2', '--global-batch-size', '8', '--device-flops', '1e12',
  '--link', 'nvlink4', '--critical-path', '--report', report, '--trace', traceFile];
const cli = execFileSync(weave, flags, { encoding: 'utf8' });
fs.writeFileSync(path.join(outDir, 'predict.txt'), cli);

// What the command line says: the path's headline and its lines, one per stay on a device.
const headline = cli.match(/critical path: (\d+) steps, ([0-9.]+) ms/);
const cliRuns = [];
for (const line of cli.split('\n')) {
  const m = line.match(
      /^\s+([0-9.]+) ms\s+([0-9.]+) %\s+device (\d+): (\d+) tasks?, ([0-9.]+) ms compute, (-?[0-9.]+) ms other; '(.*)' \.\. '(.*)', after (.+)$/);
  if (m)
    cliRuns.push({ begin: +m[1], share: +m[2], device: +m[3], tasks: +m[4], compute: +m[5],
                   other: +m[6], first: m[7], last: m[8], after: m[9] });
}
// A printed path's "by kind" lines (the first path in `text`).
const byKindOf = (text) => text.split('\n  by kind:\n')[1].split('\n  by what')[0].split('\n')
    .map((l) => l.match(/^\s+(.*\S)\s+([0-9.]+) ms\s+([0-9.]+) %$/)).filter((m) => m)
    .map((m) => ({ what: m[1], ms: +m[2], share: +m[3] }));
const cliHidden = cli.match(/\n\s+and (\d+) shorter stays/);

// A short run of a pipeline with tensor parallelism on 4 devices, reported, its path printed on
// both clocks.
const trainReport = path.resolve(outDir, 'train.html');
const trainCli = execFileSync(weave, [
  'train', '--num-layers', '2', '--hidden-size', '64', '--num-attention-heads', '4',
  '--ffn-hidden-size', '128', '--seq-length', '64', '--micro-batch-size', '2',
  '--global-batch-size', '8', '--mock-data', '--devices', '4', '--tensor-model-parallel-size', '2',
  '--sequence-parallel', '--pipeline-model-parallel-size', '2', '--train-iters', '2',
  '--trace-iteration', '2', '--critical-path', '--report', trainReport], { encoding: 'utf8' });
fs.writeFileSync(path.join(outDir, 'train.txt'), trainCli);
const wallHeadline = trainCli.match(
    /critical path on the wall clock, iteration (\d+): (\d+) steps, ([0-9.]+) ms/);
if (!wallHeadline) {
  console.error(`no critical path on the wall clock in weave train's output:\n${trainCli}`);
  process.exit(1);
}
if (!headline || cliRuns.length === 0) {
  console.error(`no critical path in weave's output:\n${cli}`);
  process.exit(1);
}

// What the Chrome trace of the same replay holds: its lanes and its tasks' tags.
const trace = JSON.parse(fs.readFileSync(traceFile, 'utf8'));
const events = trace.traceEvents || trace;
const streamNames = new Map();
for (const e of events)
  if (e.ph === 'M' && e.name === 'thread_name') streamNames.set(`${e.pid}:${e.tid}`, e.args.name);
const traceLanes = new Set();
const spans = events.filter((e) => e.ph === 'X');
for (const e of spans) traceLanes.add(`${e.pid}:${streamNames.get(`${e.pid}:${e.tid}`)}`);

const userData = fs.mkdtempSync(path.join(os.tmpdir(), 'weave-report-chromium-'));
const context = await chromium.launchPersistentContext(userData, {
  executablePath: chromiumPath,
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  viewport: { width: 1400, height: 900 },
});
try {
  const page = context.pages()[0] || (await context.newPage());
  const errors = [];
  page.on('console', (m) => { if (m.type() === 'error') errors.push(`console: ${m.text()}`); });
  page.on('pageerror', (e) => errors.push(`page error: ${e.message}`));
  page.on('request', (r) => {
    if (!r.url().startsWith('file:') && !r.url().startsWith('data:'))
      errors.push(`request leaving the file: ${r.url()}`);
  });
  const shot = async (name, target) => {
    const file = path.join(outDir, name);
    if (target) await target.screenshot({ path: file });
    else await page.screenshot({ path: file });
  };

  // A memory chart over the step for every device `cliMemory` (a command line's memory line:
  // the largest device's peak, its categories, the device count) counts, each drawing its
  // categories; the largest device's peak label and category peaks are the command line's.
  const checkMemory = async (page, cliMemory, label, screenshot) => {
    if (!check(cliMemory, `no memory line in weave ${label}'s output`)) return;
    const charts = await page.$$eval('#memory-chart g.memory-device', (gs) => gs.map((g) => ({
      device: +g.dataset.device, peak: +g.dataset.peak, peaks: g.dataset.peaks.split(' ').map(Number),
      label: g.querySelector('text.memory-peak').textContent,
      bands: [...g.querySelectorAll('path.memory-band')].map((b) => b.dataset.category),
    })));
    check(charts.length === +cliMemory[3],
          `${charts.length} memory charts, the command line counts ${cliMemory[3]} devices (${label})`);
    charts.forEach((c, i) => check(c.device === i && c.bands.includes('parameters') &&
                                   c.bands.includes('activations'),
                                   `${label}: memory chart ${i}: ${JSON.stringify(c)}`));
    // tools/weave/memory_estimate.cpp's bytes_text: fmt rounds an exact tie (228.25) to even.
    const fixed = (v, digits) => {
      const scaled = v * 10 ** digits, floor = Math.floor(scaled);
      const n = scaled - floor === 0.5 ? (floor % 2 === 0 ? floor : floor + 1) : Math.round(scaled);
      return (n / 10 ** digits).toFixed(digits);
    };
    const bytesText = (b) => b < 1024 ? `${b} B`
        : b < 1024 ** 2 ? `${fixed(b / 1024, 1)} KiB`
        : b < 1024 ** 3 ? `${fixed(b / 1024 ** 2, 1)} MiB` : `${fixed(b / 1024 ** 3, 2)} GiB`;
    const largest = charts.reduce((best, c) => (c.peak > best.peak ? c : best), charts[0]);
    check(largest && largest.label === `peak ${cliMemory[1]}`,
          `${label}: largest device's chart says '${largest && largest.label}', the command line ` +
          `'${cliMemory[1]} per device at most'`);
    const categories = await page.$$eval('#memory-legend span', (s) => s.map((x) => x.textContent));
    const pageParts = categories
        .map((c, k) => [c.replace(/_/g, ' '), largest.peaks[k]])
        .filter(([, b]) => b > 0).map(([c, b]) => `${c} ${bytesText(b)}`).join(', ');
    check(pageParts === cliMemory[2],
          `${label}: largest device's category peaks: page '${pageParts}', command line '${cliMemory[2]}'`);
    await page.evaluate(() => document.getElementById('memory-chart').scrollIntoView());
    await shot(screenshot);
  };

  // 1. It renders, with no console error.
  await page.goto(pathToFileURL(report).href);
  await page.waitForSelector('body[data-rendered="yes"]', { timeout: 10000 });
  await shot('1-rendered.png');
  check(errors.length === 0, `errors while rendering: ${errors.join('; ')}`);
  const size = fs.statSync(report).size;
  console.log(`report: ${size} bytes`);

  // 2. A lane for every device and stream of the trace, each with its tasks drawn.
  const lanes = await page.$$eval('#timeline g.lane', (gs) => gs.map((g) => ({
    key: `${g.dataset.device}:${g.dataset.stream}`,
    rects: g.querySelectorAll('rect.task').length,
  })));
  const pageLanes = new Set(lanes.map((l) => l.key));
  check(pageLanes.size === traceLanes.size && [...traceLanes].every((k) => pageLanes.has(k)),
        `lanes: page ${[...pageLanes].sort().join(' ')} against the trace's ` +
        `${[...traceLanes].sort().join(' ')}`);
  for (const l of lanes) check(l.rects > 0, `lane ${l.key} draws no task`);
  const traceDevices = [...new Set(spans.map((e) => String(e.pid)))].sort();
  const pageDevices = [...new Set(lanes.map((l) => l.key.split(':')[0]))].sort();
  check(JSON.stringify(pageDevices) === JSON.stringify(traceDevices) && traceDevices.length > 1,
        `devices: page ${pageDevices}, trace ${traceDevices}`);
  const criticalRects = await page.$$eval('#timeline rect.task.critical', (r) => r.length);
  check(criticalRects > 0, 'no task of the timeline drawn on the critical path');
  await shot('2-timeline-lanes.png', page.locator('#timeline'));

  // 3. Clicking a layer node lists its tasks: the trace's tasks of that device, stream, layer
  // and phase.
  const node = page.locator('#graph g.node[data-layer="1"][data-phase="B"]').first();
  const want = await node.evaluate((g) => ({ ...g.dataset }));
  const stream = [...streamNames.entries()].find(
      ([k, v]) => k.startsWith(`${want.device}:`) && v === want.stream)[0].split(':')[1];
  const expected = spans
      .filter((e) => String(e.pid) === want.device && String(e.tid) === stream &&
                     e.args.layer === 1 && e.args.phase === 'B')
      .map((e) => e.args.task).sort((a, b) => a - b);
  check(!(await page.locator('#node-task-table').count()), 'tasks listed before any click');
  await node.click();
  await page.waitForSelector('#node-task-table tr.node-task');
  const listed = (await page.$$eval('#node-task-table tr.node-task', (rs) =>
      rs.map((r) => +r.dataset.task))).sort((a, b) => a - b);
  check(expected.length > 1 && JSON.stringify(listed) === JSON.stringify(expected),
        `node device ${want.device} ${want.stream} layer 1 B lists tasks ${listed} against the ` +
        `trace's ${expected}`);
  check(+want.tasks === expected.length, `node says ${want.tasks} tasks, the trace has ${expected.length}`);
  const selected = await page.$$eval('#timeline rect.selected', (r) => r.length);
  check(selected === expected.length, `${selected} tasks marked in the timeline, ${expected.length} listed`);
  // Zoomed in, the timeline is twice as wide and keeps the node's tasks marked.
  const width = +(await page.getAttribute('#timeline', 'width'));
  await page.click('#zoom-in');
  const zoomed = +(await page.getAttribute('#timeline', 'width'));
  check(zoomed - 40 === 2 * (width - 40 - 210) + 210, `zoomed in: ${width} px wide, then ${zoomed}`);
  const kept = await page.$$eval('#timeline rect.selected', (r) => r.length);
  check(kept === expected.length, `zoomed in, ${kept} tasks marked, ${expected.length} before`);
  await page.click('#zoom-reset');
  await page.evaluate(() => document.getElementById('node-tasks').scrollIntoView({ block: 'end' }));
  await shot('3-node-expanded.png');

  // 4. The critical path the page lists is the one the command line printed.
  const summary = await page.textContent('#critical-path-summary');
  const pageHeadline = summary.match(/critical path: (\d+) steps, ([0-9.]+) ms/);
  check(pageHeadline && pageHeadline[1] === headline[1] && pageHeadline[2] === headline[2],
        `headline '${summary}' against the command line's '${headline[0]}'`);
  const pageRuns = await page.$$eval('#critical-path-runs tr.run', (rs) => rs.map((r) => {
    const cells = [...r.querySelectorAll('td')].map((c) => c.textContent);
    return { begin: +cells[0], share: +cells[1], device: +r.dataset.device, tasks: +r.dataset.tasks,
             compute: +cells[4], other: +cells[5], first: r.dataset.first, last: r.dataset.last,
             after: r.dataset.after };
  }));
  check(pageRuns.length === cliRuns.length,
        `the page lists ${pageRuns.length} stays on a device, the command line ${cliRuns.length}`);
  // Times printed to 3 decimals by C++ and by JavaScript may round a tie apart by one digit.
  const near = (a, b, digit) => Math.abs(a - b) <= digit * 1.01;
  cliRuns.forEach((c, i) => {
    const p = pageRuns[i];
    if (!p) return;
    check(p.device === c.device && p.tasks === c.tasks && p.first === c.first &&
          p.last === c.last && p.after === c.after && near(p.begin, c.begin, 1e-3) &&
          near(p.compute, c.compute, 1e-3) && near(p.other, c.other, 1e-3) &&
          near(p.share, c.share, 0.1),
          `stay ${i}: page ${JSON.stringify(p)} against the command line's ${JSON.stringify(c)}`);
  });
  // Its time by kind, the pipeline's bubble apart, is the command line's "by kind".
  const byKind = byKindOf(cli);
  const pageKinds = await page.$$eval('#critical-path-kinds tr.path-kind', (rs) => rs.map((r) => {
    const cells = [...r.querySelectorAll('td')].map((c) => c.textContent);
    return { what: cells[0], ms: +cells[1], share: +cells[2] };
  }));
  check(byKind.some((k) => k.what === 'pipeline bubble' && k.ms > 0) &&
        pageKinds.length === byKind.length &&
        byKind.every((k, i) => pageKinds[i].what === k.what && near(pageKinds[i].ms, k.ms, 1e-3) &&
                               near(pageKinds[i].share, k.share, 0.1)),
        `by kind: page ${JSON.stringify(pageKinds)}, command line ${JSON.stringify(byKind)}`);
  const pageHidden = (await page.textContent('#critical-path-hidden')).match(/and (\d+) shorter/);
  check((pageHidden ? pageHidden[1] : null) === (cliHidden ? cliHidden[1] : null),
        `shorter stays: page ${pageHidden && pageHidden[1]}, command line ${cliHidden && cliHidden[1]}`);
  // The exposed communication per group is the one the command line printed (groups with any).
  const cliExposed = cli.match(/\nexposed comm +(.*) ms a device/)[1];
  const pageExposed = (await page.$$eval('#exposed tr.exposed-group', (rs) => rs.map((r) =>
      [r.dataset.group, r.querySelectorAll('td')[1].textContent])))
      .filter(([, v]) => +v > 0).map(([g, v]) => `${g} ${v}`).join(', ');
  check(pageExposed === cliExposed, `exposed: page '${pageExposed}', command line '${cliExposed}'`);
  await page.evaluate(() => document.getElementById('critical-path-summary').scrollIntoView());
  await shot('4-critical-path.png');

  // 5. A memory chart over the step for every device the command line counts, each drawing its
  // categories; the largest device's peak label and category peaks are the command line's.
  await checkMemory(page, cli.match(/\nmemory +(\S+ \S+) per device at most \((.*)\); (\d+) devices?:/),
                    'predict', '5-memory.png');

  // A prediction's page has no path on the wall clock, and says so.
  check((await page.textContent('#wall-path-note')).startsWith('None') &&
        (await page.$$eval('#wall-path-runs tr.run', (rs) => rs.length)) === 0,
        'the prediction\'s page lists a path on the wall clock');

  // 6. weave train's page: a memory chart per device peaking at what train measured and printed,
  // and the critical path on the wall clock as train printed it.
  await page.goto(pathToFileURL(trainReport).href);
  await page.waitForSelector('body[data-rendered="yes"]', { timeout: 10000 });
  await checkMemory(
      page, trainCli.match(/\nmemory \(measured\): (\S+ \S+) per device at most \((.*)\); (\d+) devices?:/),
      'train', '6-train-memory.png');
  const wallSummary = await page.textContent('#wall-path-summary');
  const pageWall = wallSummary.match(
      /critical path on the wall clock, iteration (\d+): (\d+) steps, ([0-9.]+) ms/);
  check(pageWall && pageWall[0] === wallHeadline[0],
        `wall-clock headline '${wallSummary}' against the command line's '${wallHeadline[0]}'`);
  const wallKinds = byKindOf(trainCli.split('critical path on the wall clock')[1]);
  const pageWallKinds = await page.$$eval('#wall-path-kinds tr.path-kind', (rs) => rs.map((r) => {
    const cells = [...r.querySelectorAll('td')].map((c) => c.textContent);
    return { what: cells[0], ms: +cells[1], share: +cells[2] };
  }));
  check(wallKinds.some((k) => k.what === 'waits: host scheduling and launch') &&
        pageWallKinds.length === wallKinds.length &&
        wallKinds.every((k, i) => pageWallKinds[i].what === k.what &&
                                  near(pageWallKinds[i].ms, k.ms, 1e-3) &&
                                  near(pageWallKinds[i].share, k.share, 0.1)),
        `wall-clock by kind: page ${JSON.stringify(pageWallKinds)}, command line ` +
        `${JSON.stringify(wallKinds)}`);
  const wallRuns = await page.$$eval('#wall-path-runs tr.run', (rs) => rs.length);
  check(wallRuns > 0, 'the page lists no stay of the wall-clock path');
  await page.evaluate(() => document.getElementById('wall-path-summary').scrollIntoView());
  await shot('7-train-wall-path.png');
  // Only train's page has a path on the wall clock.
  check(!(await page.textContent('#wall-path-note')).startsWith('None'),
        'train\'s page says it has no wall-clock path');

  check(errors.length === 0, `errors: ${errors.join('; ')}`);
} finally {
  await context.close();
  fs.rmSync(userData, { recursive: true, force: true });
}

if (failures.length > 0) {
  for (const f of failures) console.error(`FAIL: ${f}`);
  process.exit(1);
}
console.log(`report test passed: screenshots in ${outDir}`);
