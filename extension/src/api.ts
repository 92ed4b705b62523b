import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IErrorBody } from './models';

/** An answer other than 2xx: `message` is the server's own (what failed and what to do). */
export class WorkbenchAPIError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

/**
 * Call a route under `<base_url>workbench/api/` (the one way the panel talks to the server;
 * `makeRequest` adds the token and XSRF headers).
 */
export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'workbench', 'api', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new WorkbenchAPIError(`the Jupyter server did not answer: ${error}`, 0);
  }
  const text = await response.text();
  let body: unknown = null;
  if (text) {
    try {
      body = JSON.parse(text);
    } catch {
      body = null;
    }
  }
  if (!response.ok) {
    const error = body as IErrorBody | null;
    const message = error?.error ?? `${response.status} ${response.statusText}`;
    throw new WorkbenchAPIError(message, response.status);
  }
  return body as T;
}

/** A JSON request body with its method. */
export function jsonInit(method: string, body?: unknown): RequestInit {
  return body === undefined
    ? { method }
    : { method, body: JSON.stringify(body), headers: { 'Content-Type': 'application/json' } };
}
