//! The docs against the project as it is: every command runs as written, every environment
//! variable is listed, every citation and link lands, every table renders.

#[path = "../common/mod.rs"]
mod common;

mod docs_commands;
mod docs_environment;
mod docs_links;
mod docs_tables;
mod metrics_table;
mod monitoring;
