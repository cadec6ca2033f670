/* Prints the size and field offsets of the UCP structs that src/transport/ucx/sys.rs declares,
 * one "name value" pair per line, from the installed headers (libucx-dev).
 * tests/in_process/ucx_layer.rs compiles and runs it (when gcc and the headers are present) and compares
 * with the Rust declarations; the same numbers are hard-coded there for machines without gcc.
 * By hand: gcc -o /tmp/ucx_layout src/transport/ucx/layout_probe.c && /tmp/ucx_layout */
#include <stddef.h>
#include <stdio.h>
#include <ucp/api/ucp.h>

#define SIZE(t) printf("%s.size %zu\n", #t, sizeof(t))
#define OFF(t, f) printf("%s.%s %zu\n", #t, #f, offsetof(t, f))

int main(void)
{
    SIZE(ucs_status_t);
    SIZE(ucp_params_t);
    OFF(ucp_params_t, field_mask);
    OFF(ucp_params_t, features);
    OFF(ucp_params_t, request_size);
    OFF(ucp_params_t, request_init);
    OFF(ucp_params_t, request_cleanup);
    OFF(ucp_params_t, tag_sender_mask);
    OFF(ucp_params_t, mt_workers_shared);
    OFF(ucp_params_t, estimated_num_eps);
    OFF(ucp_params_t, estimated_num_ppn);
    OFF(ucp_params_t, name);
    SIZE(ucp_context_attr_t);
    OFF(ucp_context_attr_t, field_mask);
    OFF(ucp_context_attr_t, request_size);
    OFF(ucp_context_attr_t, thread_mode);
    OFF(ucp_context_attr_t, memory_types);
    OFF(ucp_context_attr_t, name);
    SIZE(ucp_worker_params_t);
    OFF(ucp_worker_params_t, field_mask);
    OFF(ucp_worker_params_t, thread_mode);
    OFF(ucp_worker_params_t, cpu_mask);
    OFF(ucp_worker_params_t, events);
    OFF(ucp_worker_params_t, user_data);
    OFF(ucp_worker_params_t, event_fd);
    OFF(ucp_worker_params_t, flags);
    OFF(ucp_worker_params_t, name);
    OFF(ucp_worker_params_t, am_alignment);
    OFF(ucp_worker_params_t, client_id);
    SIZE(ucp_err_handler_t);
    OFF(ucp_err_handler_t, cb);
    OFF(ucp_err_handler_t, arg);
    SIZE(ucs_sock_addr_t);
    OFF(ucs_sock_addr_t, addr);
    OFF(ucs_sock_addr_t, addrlen);
    SIZE(ucp_ep_params_t);
    OFF(ucp_ep_params_t, field_mask);
    OFF(ucp_ep_params_t, address);
    OFF(ucp_ep_params_t, err_mode);
    OFF(ucp_ep_params_t, err_handler);
    OFF(ucp_ep_params_t, user_data);
    OFF(ucp_ep_params_t, flags);
    OFF(ucp_ep_params_t, sockaddr);
    OFF(ucp_ep_params_t, conn_request);
    OFF(ucp_ep_params_t, name);
    OFF(ucp_ep_params_t, local_sockaddr);
    SIZE(ucp_mem_map_params_t);
    OFF(ucp_mem_map_params_t, field_mask);
    OFF(ucp_mem_map_params_t, address);
    OFF(ucp_mem_map_params_t, length);
    OFF(ucp_mem_map_params_t, flags);
    OFF(ucp_mem_map_params_t, prot);
    OFF(ucp_mem_map_params_t, memory_type);
    SIZE(ucp_request_param_t);
    OFF(ucp_request_param_t, op_attr_mask);
    OFF(ucp_request_param_t, flags);
    OFF(ucp_request_param_t, request);
    OFF(ucp_request_param_t, cb);
    OFF(ucp_request_param_t, datatype);
    OFF(ucp_request_param_t, user_data);
    OFF(ucp_request_param_t, reply_buffer);
    OFF(ucp_request_param_t, memory_type);
    OFF(ucp_request_param_t, recv_info);
    OFF(ucp_request_param_t, memh);
    SIZE(ucp_tag_recv_info_t);
    OFF(ucp_tag_recv_info_t, sender_tag);
    OFF(ucp_tag_recv_info_t, length);
    SIZE(ucp_dt_iov_t);
    OFF(ucp_dt_iov_t, buffer);
    OFF(ucp_dt_iov_t, length);
    SIZE(ucp_generic_dt_ops_t);
    OFF(ucp_generic_dt_ops_t, start_pack);
    OFF(ucp_generic_dt_ops_t, start_unpack);
    OFF(ucp_generic_dt_ops_t, packed_size);
    OFF(ucp_generic_dt_ops_t, pack);
    OFF(ucp_generic_dt_ops_t, unpack);
    OFF(ucp_generic_dt_ops_t, finish);
    return 0;
}
