import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { jsonInit, requestAPI } from './api';
import { IClusterInfo, IJobNow, IPlotLink, IStartForm } from './models';

/** What the panel asks of the application (commands live in index.ts). */
export interface IPanelActions {
  openPlot(cluster: string, plot: IPlotLink): void;
  insertConnectionCode(cluster: string): string | null; // an error message, or null when inserted
}

const REFRESH_MS = 2000;
const SPARK_POINTS = 60;

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Record<string, string> = {},
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    node.setAttribute(key, value);
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** The left-sidebar panel: the clusters the server lists, a form to start one, and their plots. */
export class WorkbenchPanel extends Widget {
  private readonly list = el('div', { class: 'wb-clusters' });
  private readonly status = el('div', { class: 'wb-status', role: 'status' });
  private readonly cards = new Map<string, ClusterCard>();
  private timer: number | undefined;
  private refreshing = false;

  constructor(private readonly actions: IPanelActions) {
    super();
    this.id = 'workbench-panel';
    this.addClass('wb-panel');
    this.title.caption = 'Workbench: clusters and dashboards';
    const header = el('div', { class: 'wb-header' });
    header.append(el('h2', {}, 'Workbench clusters'));
    const form = new StartForm(message => this.say(message.text, message.error), () => this.refresh());
    this.node.append(header, form.node, this.status, this.list);
  }

  /** One status line: the form's feedback, or why the list could not be read (`source`). */
  say(text: string, error = false, source = 'form'): void {
    this.status.textContent = text;
    this.status.classList.toggle('wb-error', error);
    this.status.dataset.source = source;
  }

  protected onAfterAttach(): void {
    void this.refresh();
    this.timer = window.setInterval(() => void this.refresh(), REFRESH_MS);
  }

  protected onAfterShow(): void {
    void this.refresh(); // at once when the user opens the panel, not at the next tick
  }

  protected onBeforeDetach(): void {
    window.clearInterval(this.timer);
  }

  /** Ask the server for the clusters and redraw (cards are kept, so inputs and sparklines stay). */
  async refresh(): Promise<void> {
    if (this.refreshing || !this.isVisible) {
      return;
    }
    this.refreshing = true;
    try {
      const body = await requestAPI<{ clusters: IClusterInfo[] }>('clusters');
      this.render(body.clusters);
      if (this.status.dataset.source === 'list') {
        this.say('');
      }
    } catch (error) {
      this.say(`Could not list clusters: ${errorText(error)}`, true, 'list');
    } finally {
      this.refreshing = false;
    }
  }

  private render(clusters: IClusterInfo[]): void {
    const names = new Set(clusters.map(c => c.name));
    for (const [name, card] of this.cards) {
      if (!names.has(name)) {
        card.node.remove();
        this.cards.delete(name);
      }
    }
    clusters.forEach((info, position) => {
      let card = this.cards.get(info.name);
      if (!card) {
        card = new ClusterCard(info.name, this.actions, () => this.refresh());
        this.cards.set(info.name, card);
      }
      // the server's order (by name); a card already in place is not moved, since moving a node takes
      // the focus from the field the user is typing in
      const there = this.list.children[position] ?? null;
      if (there !== card.node) {
        this.list.insertBefore(card.node, there);
      }
      card.update(info);
    });
    if (!clusters.length) {
      this.list.replaceChildren(
        el('p', { class: 'wb-empty' }, 'No cluster runs. Start one above, or from a notebook: wb.Cluster(ps=1, workers=2).start()')
      );
    } else {
      this.list.querySelector('.wb-empty')?.remove();
    }
  }
}

/** The "new cluster" form: fields as in `StartForm` (Python), choices from `/options`. */
class StartForm {
  readonly node = el('details', { class: 'wb-start' });
  private readonly engines = el('select', { name: 'engines' });
  private readonly profile = el('select', { name: 'profile' });

  constructor(
    private readonly say: (message: { text: string; error: boolean }) => void,
    private readonly changed: () => Promise<void>
  ) {
    this.node.append(el('summary', {}, 'New cluster'));
    const form = el('form', { class: 'wb-start-form' });
    const field = (label: string, input: HTMLElement) => {
      const row = el('label', {}, label);
      row.append(input);
      form.append(row);
    };
    field('ps tasks', el('input', { name: 'ps', type: 'number', min: '0', max: '64', value: '1' }));
    field('workers', el('input', { name: 'workers', type: 'number', min: '1', max: '64', value: '2' }));
    field('GPUs per worker', el('input', { name: 'gpus_per_worker', type: 'number', min: '0', max: '64', value: '0' }));
    field('launcher', this.engines);
    field('ipyparallel profile', this.profile);
    field('name (optional)', el('input', { name: 'name', type: 'text', placeholder: 'wb-…' }));
    // the launcher's main options (what a batch site or other hosts need); none for local engines
    const site = el('details', { class: 'wb-start-site' });
    site.append(el('summary', {}, 'Launcher options'));
    form.append(site);
    const option = (label: string, name: string, placeholder: string) => {
      const row = el('label', {}, label);
      row.append(el('input', { name, type: 'text', placeholder }));
      site.append(row);
    };
    option('controller address', 'controller_ip', 'an address the engines reach');
    option('queue', 'queue', 'batch launchers: partition');
    option('account', 'account', 'batch launchers');
    option('time limit', 'timelimit', 'HH:MM:SS');
    const others = el('label', {}, 'other options (KEY=VALUE, one a line)');
    others.append(el('textarea', { name: 'options', rows: '3', placeholder: "hosts={'node1': 2}" }));
    site.append(others);
    const start = el('button', { type: 'submit', class: 'jp-mod-styled jp-mod-accept wb-start-button' }, 'Start');
    form.append(start);
    form.addEventListener('submit', event => {
      event.preventDefault();
      void this.submit(form, start);
    });
    this.node.append(form);
    this.node.addEventListener('toggle', () => void this.loadOptions(), { once: true });
  }

  private async loadOptions(): Promise<void> {
    try {
      const options = await requestAPI<{ engines: string[]; profiles: string[] }>('options');
      this.engines.replaceChildren(...options.engines.map(e => el('option', { value: e }, e)));
      this.profile.replaceChildren(
        el('option', { value: '' }, '(default)'),
        ...options.profiles.map(p => el('option', { value: p }, p))
      );
    } catch (error) {
      this.say({ text: `Could not read the launchers: ${errorText(error)}`, error: true });
    }
  }

  private async submit(form: HTMLFormElement, button: HTMLButtonElement): Promise<void> {
    const data = new FormData(form);
    const number = (key: string) => Number(data.get(key));
    const body: IStartForm = {
      ps: number('ps'),
      workers: number('workers'),
      gpus_per_worker: number('gpus_per_worker'),
      engines: String(data.get('engines') || 'local'),
      profile: String(data.get('profile') || ''),
      name: String(data.get('name') || '') || null,
      controller_ip: String(data.get('controller_ip') || '').trim(),
      queue: String(data.get('queue') || '').trim(),
      account: String(data.get('account') || '').trim(),
      timelimit: String(data.get('timelimit') || '').trim(),
      options: String(data.get('options') || '')
    };
    button.disabled = true;
    this.say({ text: 'Starting a cluster: engines, then one TensorFlow server each…', error: false });
    try {
      const info = await requestAPI<IClusterInfo>('clusters', jsonInit('POST', body));
      this.say({ text: `Cluster ${info.name} started (${info.tasks.length} tasks).`, error: false });
      await this.changed();
    } catch (error) {
      this.say({ text: `Could not start the cluster: ${errorText(error)}`, error: true });
    } finally {
      button.disabled = false;
    }
  }
}

/** One cluster: tasks, live throughput, plot buttons, connection code, scale and stop. */
class ClusterCard {
  readonly node: HTMLElement;
  private readonly heading = el('div', { class: 'wb-card-heading' });
  private readonly links = el('div', { class: 'wb-links' }); // the emulated links' shaping (network=)
  private readonly tasks = el('table', { class: 'wb-tasks' });
  private readonly live = el('div', { class: 'wb-live' });
  private readonly spark = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  private readonly plots = el('div', { class: 'wb-plots' });
  private readonly feedback = el('div', { class: 'wb-feedback', role: 'status' });
  private readonly workers = el('input', { type: 'number', min: '1', max: '64', class: 'wb-workers' });
  private readonly rates: number[] = [];
  private plotsLoaded = false;
  private busy = false;
  private workersEdited = false; // the user typed a count: refreshes must not overwrite it before Scale

  constructor(
    private readonly name: string,
    private readonly actions: IPanelActions,
    private readonly changed: () => Promise<void>
  ) {
    this.node = el('section', { class: 'wb-card', 'data-cluster': name });
    this.spark.setAttribute('class', 'wb-spark');
    this.spark.setAttribute('viewBox', `0 0 ${SPARK_POINTS} 20`);
    this.spark.setAttribute('preserveAspectRatio', 'none');
    const actionsRow = el('div', { class: 'wb-actions' });
    const insert = el('button', { class: 'jp-mod-styled wb-insert' }, 'Insert connection code');
    insert.addEventListener('click', () => {
      const problem = this.actions.insertConnectionCode(this.name);
      this.tell(problem ?? 'Inserted into the notebook below the active cell.', problem !== null);
    });
    const scale = el('button', { class: 'jp-mod-styled wb-scale' }, 'Scale');
    scale.addEventListener('click', () => void this.scale());
    const stop = el('button', { class: 'jp-mod-styled jp-mod-warn wb-stop' }, 'Stop');
    stop.addEventListener('click', () => void this.stop());
    this.workers.addEventListener('input', () => {
      this.workersEdited = true;
    });
    const workersLabel = el('label', {}, 'workers ');
    workersLabel.append(this.workers);
    actionsRow.append(insert, workersLabel, scale, stop);
    const liveRow = el('div', { class: 'wb-live-row' });
    liveRow.append(this.live, this.spark);
    this.node.append(this.heading, this.links, this.tasks, liveRow, this.plots, actionsRow, this.feedback);
  }

  update(info: IClusterInfo): void {
    const owner = info.owned_here ? 'started from this panel' : `owner pid ${info.client_pid}`;
    this.heading.replaceChildren(
      el('span', { class: 'wb-name' }, info.name),
      el('span', { class: `wb-state wb-state-${info.state}` }, info.state),
      el('span', { class: 'wb-owner' }, `${info.engines} · ${owner}`)
    );
    this.links.textContent = info.network ? `links: ${info.network}` : '';
    this.links.hidden = !info.network;
    const head = el('tr');
    for (const title of ['task', 'address', 'health']) {
      head.append(el('th', {}, title));
    }
    const rows = info.tasks.map(task => {
      const row = el('tr', { 'data-task': task.name });
      const devices = task.devices.map(d => d.split('/device:')[1] ?? d).join(', ');
      const health = task.restarts > 0 ? `${task.state}, re-hosted ${task.restarts}x` : task.state;
      // three columns fit the sidebar at its default width: engine and devices go under the task's name
      const name = el('td', {}, task.name);
      name.append(el('div', { class: 'wb-sub' }, `engine ${task.engine_id} · ${devices || '—'}`));
      row.append(name, el('td', {}, task.address), el('td', {}, health));
      const cell = row.lastElementChild as HTMLElement | null;
      cell?.classList.add(`wb-health-${task.state}`);
      if (cell && task.note) {
        cell.title = task.note; // why: "its engine exited", "not answering", "re-hosted on engine 3"
      }
      return row;
    });
    this.tasks.replaceChildren(head, ...rows);
    if (!this.workersEdited && document.activeElement !== this.workers && !this.busy) {
      this.workers.value = String(info.tasks.filter(t => t.job === 'worker').length);
    }
    for (const button of this.node.querySelectorAll<HTMLButtonElement>('.wb-scale, .wb-stop')) {
      button.disabled = this.busy || !info.controllable;
      button.title = info.controllable ? '' : 'Its owner has no control endpoint: act on it from the owner';
    }
    if (info.controllable) {
      void this.refreshLive();
      if (!this.plotsLoaded) {
        void this.loadPlots();
      }
    }
  }

  private tell(text: string, error = false): void {
    this.feedback.textContent = text;
    this.feedback.classList.toggle('wb-error', error);
  }

  private async loadPlots(): Promise<void> {
    this.plotsLoaded = true;
    try {
      const body = await requestAPI<{ plots: IPlotLink[] }>(`clusters/${encodeURIComponent(this.name)}/plots`);
      this.plots.replaceChildren(
        ...body.plots.map(plot => {
          const button = el('button', { class: 'jp-mod-styled wb-plot', 'data-plot': plot.name }, plot.title);
          button.addEventListener('click', () => this.actions.openPlot(this.name, plot));
          return button;
        })
      );
    } catch (error) {
      this.plotsLoaded = false; // try again on the next refresh
      this.plots.replaceChildren(el('span', { class: 'wb-error' }, `Plots unavailable: ${errorText(error)}`));
    }
  }

  private async refreshLive(): Promise<void> {
    let job: IJobNow | null;
    try {
      job = (await requestAPI<{ job: IJobNow | null }>(`clusters/${encodeURIComponent(this.name)}/summary`)).job;
    } catch {
      return; // the list refresh reports a cluster that went away
    }
    if (!job) {
      this.live.textContent = 'No job yet';
      return;
    }
    this.rates.push(job.state === 'running' ? job.examples_per_s : 0);
    this.rates.splice(0, Math.max(0, this.rates.length - SPARK_POINTS));
    this.live.replaceChildren(
      el('div', { class: 'wb-rate' }, `${job.examples_per_s.toFixed(0)} examples/s`),
      el('div', { class: 'wb-job' }, `${job.steps_per_s.toFixed(1)} steps/s · ${job.job} ${job.state} ${job.steps_done}/${job.steps_total}`),
      ...(job.running ?? []).map(line => el('div', { class: 'wb-queued' }, `also running: ${line}`)),
      ...(job.queued ?? []).map(line => el('div', { class: 'wb-queued' }, `queued: ${line}`))
    );
    const top = Math.max(...this.rates, 1e-9);
    const points = this.rates.map((r, i) => `${i + SPARK_POINTS - this.rates.length},${(20 - (18 * r) / top).toFixed(1)}`);
    const line = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
    line.setAttribute('points', points.join(' '));
    this.spark.replaceChildren(line);
  }

  private async scale(): Promise<void> {
    const workers = Number(this.workers.value);
    this.busy = true;
    this.tell(`Scaling to ${workers} worker(s)…`);
    try {
      const info = await requestAPI<IClusterInfo>(`clusters/${encodeURIComponent(this.name)}`, jsonInit('PATCH', { workers }));
      this.tell(`Now ${info.tasks.filter(t => t.job === 'worker').length} worker(s).`);
    } catch (error) {
      this.tell(`Could not scale: ${errorText(error)}`, true);
    } finally {
      this.busy = false;
      this.workersEdited = false; // from now on the field shows the cluster's count again
      await this.changed();
    }
  }

  private async stop(): Promise<void> {
    const answer = await showDialog({
      title: `Stop cluster ${this.name}?`,
      body: 'Its engines and TensorFlow servers stop; a notebook using it loses its cluster.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (!answer.button.accept) {
      return;
    }
    this.busy = true;
    this.tell('Stopping…');
    try {
      await requestAPI(`clusters/${encodeURIComponent(this.name)}`, jsonInit('DELETE'));
      this.tell('Stopped.');
    } catch (error) {
      this.tell(`Could not stop: ${errorText(error)}`, true);
    } finally {
      this.busy = false;
      await this.changed();
    }
  }
}
