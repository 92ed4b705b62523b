import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';

/**
 * Widget outputs that JupyterLab's widget manager gave up on while it restored them, rendered again.
 *
 * When a notebook is opened or reloaded, each widget output asks the widget manager for its model and
 * waits 2 s for it, checking every 100 ms; once the manager has restored the kernel's widgets, an output
 * whose model it did not see reads "Error displaying widget: model not found" for good. On a busy page
 * (a machine whose cores train, a live dashboard drawing) the last check can wake past the 2 s after the
 * model arrived: the model is there, and the output still reads the error. Such an output is rendered
 * again, up to RETRIES times, while the page restores: for a while after each connection of its kernel.
 */

const WIDGET_MIME = 'application/vnd.jupyter.widget-view+json';
const GAVE_UP = 'model not found'; // the end of the manager's "Error displaying widget: model not found"
const RETRIES = 3; // per output: a model that is really gone (the kernel restarted) reads the error after them
const CHECK_MS = 1000;
const CHECKS = 60; // a minute after each connection: the restore of a busy kernel's widgets fits in it

/** The parts of an output area this uses (``@jupyterlab/outputarea``'s ``OutputArea``). */
interface IRenderer {
  readonly node: HTMLElement;
  renderModel(model: unknown): Promise<void>;
}
interface IOutputItem {
  readonly widgets?: readonly object[];
}
interface IOutputArea {
  readonly widgets: readonly IOutputItem[];
  readonly model: { readonly length: number; get(index: number): { readonly data: Record<string, unknown> } };
}

const retried = new WeakMap<IRenderer, number>();

/** The renderer of an output item: the last of its widgets that renders a model, as ``OutputArea`` finds it. */
function rendererOf(item: IOutputItem): IRenderer | undefined {
  const renderers = (item.widgets ?? []).filter(widget => 'renderModel' in widget) as IRenderer[];
  return renderers.pop();
}

/** Render again each widget output of ``panel`` that reads the manager's error (each up to RETRIES times). */
function rerenderGivenUp(panel: NotebookPanel): void {
  for (const cell of panel.content.widgets) {
    if (cell.model.type !== 'code') {
      continue;
    }
    const area = (cell as unknown as { outputArea: IOutputArea }).outputArea;
    area.widgets.forEach((item, index) => {
      const renderer = rendererOf(item);
      if (renderer === undefined || index >= area.model.length) {
        return;
      }
      const tries = retried.get(renderer) ?? 0;
      const output = area.model.get(index);
      if (tries < RETRIES && WIDGET_MIME in output.data && renderer.node.textContent?.endsWith(GAVE_UP)) {
        retried.set(renderer, tries + 1);
        void renderer.renderModel(output);
      }
    });
  }
}

/** Watch every notebook of ``notebooks`` for widget outputs given up on while its kernel's widgets are restored. */
export function watchWidgetRestores(notebooks: INotebookTracker): void {
  notebooks.widgetAdded.connect((_, panel) => {
    let timer = 0;
    const watch = (): void => {
      window.clearInterval(timer);
      let checks = 0;
      timer = window.setInterval(() => {
        checks += 1;
        if (checks >= CHECKS || panel.isDisposed) {
          window.clearInterval(timer);
          return;
        }
        rerenderGivenUp(panel);
      }, CHECK_MS);
    };
    watch();
    panel.sessionContext.connectionStatusChanged.connect((__, status) => {
      if (status === 'connected') {
        watch();
      }
    });
    panel.disposed.connect(() => window.clearInterval(timer));
  });
}
