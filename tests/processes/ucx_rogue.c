/* A hostile UCX peer, for tests/processes/e2e_ucx_rogue.rs: it has no token and never says Hello. It
 * connects to a victim's UCX worker address and asks for what libucx executes on behalf of any
 * connected peer when the victim's context has RMA (its software put/get handlers over tcp and
 * shared memory): a read or a write of the victim's memory at an address of the rogue's
 * choosing, with a remote key the rogue packed for its own memory.
 *
 *   ucx_rogue HEX_ADDRESS get ADDR LEN TIMEOUT_MS     read LEN bytes of the victim at ADDR
 *   ucx_rogue HEX_ADDRESS put ADDR LEN TIMEOUT_MS     write LEN bytes of 0xAB there
 *   ucx_rogue HEX_ADDRESS flood TAG LEN TIMEOUT_MS COUNT
 *                                  send COUNT tagged messages of LEN bytes under TAG, TAG+1...
 *
 * ADDR and TAG are hexadecimal. Prints one JSON line: {"op":..,"status":..,"data":".."} where
 * status is "ok" (the victim did it; data: what a get read, in hex; for a flood, every message
 * left, data: how many), "timeout" (no answer within TIMEOUT_MS: the victim dropped the
 * request) or UCX's name of the error. Exit 0 whatever the victim did; 2 on bad arguments or a
 * failure of the rogue's own UCX. A flood goes eagerly where the environment says so
 * (UCX_RNDV_THRESH=inf): the victim's UCX then takes every byte of a message nobody receives
 * into its unexpected queue.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

static int done;
static ucs_status_t result;
static size_t sent, failed;

static void flooded(void *request, ucs_status_t status, void *user) {
  (void)request;
  (void)user;
  if (status == UCS_OK)
    sent++;
  else
    failed++;
}

static void completed(void *request, ucs_status_t status, void *user) {
  (void)request;
  (void)user;
  result = status;
  done = 1;
}

static void on_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  (void)arg;
  (void)ep;
  result = status;
  done = 1;
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Waits for `request` until `deadline`: 1 when it ended (its status in `result`), 0 if not. */
static int wait_for(ucp_worker_h worker, ucs_status_ptr_t request, double deadline) {
  if (UCS_PTR_IS_ERR(request)) {
    result = UCS_PTR_STATUS(request);
    return 1;
  }
  if (request == NULL) {
    result = UCS_OK;
    return 1;
  }
  done = 0;
  while (!done && now_ms() < deadline) ucp_worker_progress(worker);
  return done;
}

static int unhex(const char *s, uint8_t *out, size_t max) {
  size_t n = strlen(s);
  if (n % 2 || n / 2 > max) return -1;
  for (size_t i = 0; i < n / 2; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    out[i] = (uint8_t)v;
  }
  return (int)(n / 2);
}

#define CHECK(call)                                                              \
  do {                                                                           \
    ucs_status_t s_ = (call);                                                    \
    if (s_ != UCS_OK) {                                                          \
      fprintf(stderr, "ucx_rogue: %s: %s\n", #call, ucs_status_string(s_));      \
      return 2;                                                                  \
    }                                                                            \
  } while (0)

int main(int argc, char **argv) {
  if (argc != 6 && argc != 7) {
    fprintf(stderr, "usage: ucx_rogue HEX_ADDRESS get|put|flood ADDR LEN TIMEOUT_MS [COUNT]\n");
    return 2;
  }
  static uint8_t address[4096];
  int address_len = unhex(argv[1], address, sizeof(address));
  const char *op = argv[2];
  uint64_t target = strtoull(argv[3], NULL, 16);
  size_t len = strtoull(argv[4], NULL, 10);
  double timeout = strtod(argv[5], NULL);
  int is_get = strcmp(op, "get") == 0;
  int is_flood = strcmp(op, "flood") == 0;
  size_t count = argc == 7 ? strtoull(argv[6], NULL, 10) : 0;
  if (address_len <= 0 || (!is_get && !is_flood && strcmp(op, "put") != 0) || len == 0 ||
      len > (is_flood ? (64u << 20) : (1u << 20)) || (is_flood != (count > 0))) {
    fprintf(stderr, "ucx_rogue: bad arguments\n");
    return 2;
  }

  ucp_config_t *config;
  CHECK(ucp_config_read(NULL, NULL, &config));
  ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                         .features = UCP_FEATURE_RMA | UCP_FEATURE_TAG};
  ucp_context_h context;
  CHECK(ucp_init(&params, config, &context));
  ucp_config_release(config);
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  ucp_worker_h worker;
  CHECK(ucp_worker_create(context, &wp, &worker));
  ucp_ep_params_t ep_params = {
      .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER,
      .address = (ucp_address_t *)address,
      .err_mode = UCP_ERR_HANDLING_MODE_PEER,
      .err_handler = {.cb = on_error, .arg = NULL}};
  ucp_ep_h ep;
  CHECK(ucp_ep_create(worker, &ep_params, &ep));

  if (is_flood) {
    /* Every message queued at once, from one buffer; each completes once its bytes left. */
    uint8_t *payload = malloc(len);
    memset(payload, 0x5f, len);
    ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK,
                              .cb = {.send = flooded}};
    for (size_t i = 0; i < count; i++) {
      ucs_status_ptr_t r = ucp_tag_send_nbx(ep, payload, len, target + i, &fp);
      if (UCS_PTR_IS_ERR(r))
        failed++;
      else if (r == NULL)
        sent++;
    }
    double deadline = now_ms() + timeout;
    while (sent + failed < count && now_ms() < deadline) ucp_worker_progress(worker);
    const char *status = sent == count ? "ok" : failed > 0 ? "failed" : "timeout";
    printf("{\"op\":\"flood\",\"status\":\"%s\",\"data\":\"%zu\"}\n", status, sent);
    fflush(stdout);
    _exit(0);
  }

  /* A key for the rogue's own buffer: over transports without native RMA, libucx carries the
   * operation to the victim as a message naming the victim's address, whatever the key. */
  uint8_t *buffer = calloc(1, len);
  memset(buffer, is_get ? 0 : 0xAB, len);
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                           UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                             .address = buffer,
                             .length = len};
  ucp_mem_h memh;
  CHECK(ucp_mem_map(context, &mp, &memh));
  void *packed;
  size_t packed_len;
  CHECK(ucp_rkey_pack(context, memh, &packed, &packed_len));
  ucp_rkey_h rkey;
  CHECK(ucp_ep_rkey_unpack(ep, packed, &rkey));

  ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK,
                            .cb = {.send = completed}};
  double deadline = now_ms() + timeout;
  int finished = wait_for(worker, is_get ? ucp_get_nbx(ep, buffer, len, target, rkey, &rp)
                                         : ucp_put_nbx(ep, buffer, len, target, rkey, &rp),
                          deadline);
  /* A put completes once its bytes left; the flush, once the victim applied it. */
  if (finished && result == UCS_OK && !is_get)
    finished = wait_for(worker, ucp_ep_flush_nbx(ep, &rp), deadline);

  const char *status =
      !finished ? "timeout" : result == UCS_OK ? "ok" : ucs_status_string(result);
  printf("{\"op\":\"%s\",\"status\":\"%s\",\"data\":\"", op, status);
  if (finished && result == UCS_OK && is_get)
    for (size_t i = 0; i < len; i++) printf("%02x", buffer[i]);
  printf("\"}\n");
  fflush(stdout);
  /* No teardown: a request may still be outstanding, and the process ends here. */
  _exit(0);
}
