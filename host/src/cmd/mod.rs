//! One module per command.

pub mod bench;
pub mod inspect;
pub mod models;
