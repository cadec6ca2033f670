// Raw UCX tag stream between two processes, the measurements behind `EAGER_SPIN` (a 50 us poll:
// 6.0-6.2 GB/s, sleeping at once 5.0-5.3) and `MAX_PIECES` (8 pieces as fast as one buffer): 4096
// messages of 1 MiB (PROBE_MSG bytes if set), K in flight, sent from and received into one fixed offset (`fixed`, as
// ucx_perftest does), or successive offsets of 512 MiB buffers (`rotate`, as KV pools), or sent
// as an io-vector of a 64-byte prefix and N pieces of such a buffer (`iov N`), or received
// through a UCP generic datatype whose unpack callback copies each fragment into the rotating
// buffer (`generic`). The receiver counts the bytes that did not land. Both sides busy-poll,
// unless PROBE_SLEEP is set: then a side that finds nothing to do for PROBE_SPIN_US (default 0)
// arms its worker and sleeps on its event fd, as the agents' progress threads do.
// Build: gcc -O2 -o /tmp/ucx-stream scripts/probes/ucx-stream.c -lucp -lucs
// Run:   UCX_TLS=tcp UCX_NET_DEVICES=lo /tmp/ucx-stream fixed|rotate|iov|generic [messages] [pieces]
//        (kvferry's eager settings: UCX_RNDV_THRESH=inf UCX_TCP_TX_SEG_SIZE=1M UCX_TCP_RX_SEG_SIZE=1M)
#define _GNU_SOURCE
#include <ucp/api/ucp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <poll.h>
#define BUF (512UL<<20)
static size_t MSG=1UL<<20;
#define K 8
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int done_count;
typedef struct { char*at; size_t len; } unpk_t;
static void* g_start_pack(void*c,const void*b,size_t n){(void)c;(void)b;(void)n;return 0;}
static void* g_start_unpack(void*c,void*b,size_t n){(void)c; unpk_t*u=malloc(sizeof *u); u->at=b; u->len=n; return u;}
static size_t g_size(void*s){return ((unpk_t*)s)->len;}
static size_t g_pack(void*s,size_t o,void*d,size_t m){(void)s;(void)o;(void)d;(void)m;return 0;}
static ucs_status_t g_unpack(void*s,size_t o,const void*src,size_t l){unpk_t*u=s; memcpy(u->at+o,src,l); return UCS_OK;}
static void g_finish(void*s){free(s);}
static ucp_generic_dt_ops_t gops={g_start_pack,g_start_unpack,g_size,g_pack,g_unpack,g_finish};
static void cb_send(void*r,ucs_status_t s,void*u){ ucp_request_free(r);(void)u; if(s!=UCS_OK){fprintf(stderr,"send %s\n",ucs_status_string(s));exit(1);} done_count++;}
static void cb_recv(void*r,ucs_status_t s,const ucp_tag_recv_info_t*i,void*u){ucp_request_free(r);(void)i;(void)u; if(s!=UCS_OK){fprintf(stderr,"recv %s\n",ucs_status_string(s));exit(1);} done_count++;}
int main(int argc,char**argv){ if(getenv("PROBE_MSG")) MSG=atol(getenv("PROBE_MSG"));
  int rotate=argc>1&&strcmp(argv[1],"fixed"); int iov=argc>1&&!strcmp(argv[1],"iov"); int np=argc>3?atoi(argv[3]):1; static ucp_dt_iov_t vv[1100]; static char hdr[64]; long n=argc>2?atol(argv[2]):4096;
  int sv[2]; socketpair(AF_UNIX,SOCK_STREAM,0,sv);
  pid_t pid=fork(); int sender=(pid==0); int sock=sender?sv[1]:sv[0];
  char*buf=mmap(0,BUF,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(buf,BUF,MADV_HUGEPAGE); memset(buf,sender?7:0,BUF);
  ucp_params_t p={.field_mask=UCP_PARAM_FIELD_FEATURES,.features=UCP_FEATURE_TAG};
  int sleepy=getenv("PROBE_SLEEP")!=0; if(sleepy) p.features|=UCP_FEATURE_WAKEUP;
  ucp_config_t*cfg; ucp_config_read(NULL,NULL,&cfg); ucp_context_h ctx; if(ucp_init(&p,cfg,&ctx)!=UCS_OK)return 1;
  ucp_worker_params_t wp={.field_mask=UCP_WORKER_PARAM_FIELD_THREAD_MODE,.thread_mode=UCS_THREAD_MODE_SINGLE};
  ucp_worker_h w; ucp_worker_create(ctx,&wp,&w);
  ucp_address_t*a; size_t al; ucp_worker_get_address(w,&a,&al);
  write(sock,&al,8); write(sock,a,al); size_t rl; read(sock,&rl,8); char*ra=malloc(rl); size_t got=0; while(got<rl) got+=read(sock,ra+got,rl-got);
  ucp_ep_params_t ep={.field_mask=UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,.address=(ucp_address_t*)ra}; ucp_ep_h e=0; if(sender) ucp_ep_create(w,&ep,&e);
  char c=1; write(sock,&c,1); read(sock,&c,1);
  ucp_request_param_t sp={.op_attr_mask=UCP_OP_ATTR_FIELD_CALLBACK,.cb.send=cb_send};
  ucp_request_param_t rp={.op_attr_mask=UCP_OP_ATTR_FIELD_CALLBACK,.cb.recv=cb_recv};
  int generic=argc>1&&!strcmp(argv[1],"generic"); ucp_datatype_t gdt; if(generic){ucp_dt_create_generic(&gops,0,&gdt); rp.op_attr_mask|=UCP_OP_ATTR_FIELD_DATATYPE; rp.datatype=gdt;}
  long issued=0; double t0=0; double last=now(); double spin=getenv("PROBE_SPIN_US")?atof(getenv("PROBE_SPIN_US"))*1e-6:0;
  while(done_count<n){
    while(issued<n && issued-done_count<K){
      char*at=buf+(rotate?(issued*MSG)%BUF:0);
      vv[0].buffer=hdr; vv[0].length=64; size_t ps=(MSG-64)/np; for(int k=0;k<np;k++){vv[1+k].buffer=buf+((issued*2*MSG+2*k*ps)%(BUF-2*MSG)); vv[1+k].length=(k==np-1)?(MSG-64-ps*(np-1)):ps;} ucp_request_param_t sp2=sp; if(iov){sp2.op_attr_mask|=UCP_OP_ATTR_FIELD_DATATYPE; sp2.datatype=ucp_dt_make_iov();}
      void*r= sender? ucp_tag_send_nbx(e,iov?(void*)vv:(void*)at,iov?1+np:MSG,issued,&sp2) : ucp_tag_recv_nbx(w,at,MSG,issued,(ucp_tag_t)-1,&rp);
      if(UCS_PTR_IS_ERR(r)){fprintf(stderr,"err\n");return 1;}
      if(r==NULL) done_count++;
      if(issued==16) t0=now();
      issued++;
    }
    if(ucp_worker_progress(w)) last=now();
    else if(sleepy && now()-last>spin){ int fd; ucp_worker_get_efd(w,&fd); if(ucp_worker_arm(w)==UCS_OK){ struct pollfd pf={fd,POLLIN,0}; poll(&pf,1,100); } }
  }
  double dt=now()-t0;
  if(!sender) printf("%s %d: %.2f GB/s (%ld x %zu B)\n",argc>1?argv[1]:"fixed",np,(n-16)*MSG/dt/1e9,n,MSG);
  if(!sender && !iov){size_t lim=(size_t)n*MSG<BUF?(size_t)n*MSG:BUF, bad=0; for(size_t i=0;i<lim;i++) bad+=buf[i]!=7; printf("bytes not landed: %zu of %zu\n",bad,lim);}
  write(sock,&c,1); read(sock,&c,1);
  if(!sender) wait(0);
  return 0;}
