/* Build: gcc train.c -I../../native -L../../build/native -Wl,-rpath,$PWD/../../build/native -ldsec_inject
 * Run:   DSEC_ENDPOINT=http://127.0.0.1:8080 DSEC_SANDBOX_ID=pool-0 DSEC_TOKEN=dsp_... ./a.out */
#include "dsec_inject.h"

int main(void)
{
    dsec_init(NULL, "my-trainer"); /* endpoint from DSEC_ENDPOINT; pool and token from the environment */
    for (long episode = 0; episode < 100; episode++) dsec_report_episode_end(0.5 * episode, 200);
    dsec_shutdown(); /* a final heartbeat, then deregistered */
    return 0;
}
