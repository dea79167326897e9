//! placeholder
pub mod mock_upstream;
pub use mock_upstream::MockUpstream;
