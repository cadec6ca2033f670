// process_vm_readv (cma, UCX's shared-memory read) from a 512 MiB source process into a local
// buffer, by 1 or 2 reader threads: contiguous 1 MiB reads (a placed run) against 1 MiB read
// into `piece`-byte local pieces at twice their stride (a decode holding twice the heads of
// its source, token-major: 1 KiB head slices for llama3-8b). Measured here with 2 threads:
// contiguous 9.4-11.9 GB/s, 1 KiB pieces 0.53-0.66x of that, 16 KiB pieces 0.79-0.88x.
// Build: gcc -O2 -pthread -o /tmp/cma-pieces scripts/probes/cma-pieces.c
// Run:   /tmp/cma-pieces 1024; /tmp/cma-pieces 16384
#define _GNU_SOURCE
#include <sys/uio.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <signal.h>
#define SZ (512UL<<20)
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static char* alloc(size_t n){char*p=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);madvise(p,n,MADV_HUGEPAGE);memset(p,1,n);return p;}
static pid_t pid; static char*src,*dst; static size_t piece; static int pieces_mode, nthreads;
static void* reader(void*arg){ long t=(long)arg; struct iovec l[1024],r[1];
  size_t per=(1<<20)/piece; size_t batch=per*piece; size_t half=SZ/nthreads;
  for(size_t off=t*half;off<(t+1)*half;off+=batch){
    if(pieces_mode){for(size_t i=0;i<per;i++){l[i].iov_base=dst+2*off+2*i*piece;l[i].iov_len=piece;}}
    else {l[0].iov_base=dst+off;l[0].iov_len=batch;}
    r[0].iov_base=src+off;r[0].iov_len=batch;
    if(process_vm_readv(pid,l,pieces_mode?per:1,r,1,0)!=(ssize_t)batch){perror("readv");exit(1);}}
  return 0;}
static double run(int mode,int th){pieces_mode=mode;nthreads=th;pthread_t ts[2];double t=now();
  for(long i=0;i<th;i++) pthread_create(&ts[i],0,reader,(void*)i);
  for(int i=0;i<th;i++) pthread_join(ts[i],0);
  return SZ/(now()-t)/1e9;}
int main(int argc,char**argv){piece=argc>1?atol(argv[1]):1024; src=alloc(SZ); pid=fork(); if(!pid){pause();return 0;}
  dst=alloc(2*SZ); run(0,1); run(1,1);
  for(int rep=0;rep<3;rep++){double a1=run(0,1),b1=run(1,1),a2=run(0,2),b2=run(1,2);
    printf("piece %zu: 1 reader contiguous %.2f pieces %.2f (%.2f)  2 readers contiguous %.2f pieces %.2f (%.2f)\n",piece,a1,b1,b1/a1,a2,b2,b2/a2);}
  kill(pid,9);wait(0);return 0;}
