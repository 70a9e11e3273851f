/*
 * libdsec_inject: report a native (C/C++/CUDA) training process to a DSec control plane.
 *
 * Two ways to use it (docs/native.md):
 *   - link it and call the three functions below;
 *   - LD_PRELOAD it: it then interposes cudaMalloc / cudaFree / ncclAllReduce, and starts reporting by
 *     itself when DSEC_ENDPOINT and DSEC_SANDBOX_ID are set (stopping, with a final heartbeat, at exit).
 *
 * Configuration comes from the environment, as for the Python probe: DSEC_SANDBOX_ID (pool), DSEC_TOKEN
 * (pool token), DSEC_ENDPOINT (when `endpoint` is NULL), DSEC_HEARTBEAT_INTERVAL (seconds, default 5),
 * DSEC_NAME (when `name` is NULL), DSEC_DEBUG (diagnostics on stderr; otherwise the library prints nothing).
 *
 * Every function is thread-safe and never blocks the caller on the network: reporting runs on a
 * background thread ("dsec-native"); the calls only update counters under a mutex.
 */
#ifndef DSEC_INJECT_H
#define DSEC_INJECT_H

#include <stddef.h> /* NULL, for the arguments that default to the environment */

#ifdef __cplusplus
extern "C" {
#endif

#define DSEC_INJECT_VERSION "0.1.0"

/* dsec_init return codes */
#define DSEC_OK 0                /* reporting runs (started now, or already running) */
#define DSEC_ERR_CONFIG (-1)     /* no endpoint / no DSEC_SANDBOX_ID, or the endpoint is not http://host[:port][/path] */
#define DSEC_ERR_THREAD (-2)     /* the background thread could not be started */

/* Start reporting: register as a worker (role "other", group = name) with the pool named by DSEC_SANDBOX_ID,
 * then heartbeat every DSEC_HEARTBEAT_INTERVAL seconds. `endpoint` NULL or "": DSEC_ENDPOINT. `name` NULL or
 * "": DSEC_NAME, else the program name (characters outside [A-Za-z0-9_.:-] become '_'). Returns at once;
 * an unreachable control plane is retried in the background with backoff. If reporting already runs
 * (for example started by LD_PRELOAD), returns DSEC_OK and keeps it as it is. */
int dsec_init(const char *endpoint, const char *name);

/* One finished episode: counted in episodes_total, averaged into episode_return_mean and
 * episode_length_mean for the current heartbeat interval (a non-finite reward is left out of the mean).
 * Cheap and non-blocking; may be called before dsec_init (the counts are reported once it runs). */
void dsec_report_episode_end(double reward, long length);

/* Stop reporting: one final heartbeat and a deregistration, bounded to about 3 seconds even when the
 * control plane does not answer. Idempotent; dsec_init may start reporting again afterwards. */
void dsec_shutdown(void);

#ifdef __cplusplus
}
#endif

#endif /* DSEC_INJECT_H */
